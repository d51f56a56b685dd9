//! The counting allocator (feature `meter`): a global allocator, mimalloc underneath, that counts
//! every byte it hands out, so that heap figures on the CPU are exact. Without it nothing counts,
//! and every heap figure reads zero ([`super::heap_meter_installed`] says which).
//!
//! It wraps mimalloc rather than the system allocator: glibc's malloc returns freed pages to the OS
//! eagerly, and the page faults that follow make big-activation runs slower in a way that hides the
//! cost of recomputation. mimalloc too gives freed memory back (after a delay of about a second),
//! so every training step would fault its activations in again and the kernel zero each page
//! (`clear_page_erms` measured 12-20% of a ResNet-50 step): the allocator is told never to purge,
//! so a step reuses the pages of the last one. The heap figures do not change: they count live
//! bytes, not pages held. The price is resident memory above the live heap (freed pages kept for
//! sizes that do not come back: 3-4 GiB for GPT-2 XL); where that matters more than time, set
//! mimalloc's own `MIMALLOC_PURGE_DELAY` (e.g. 0: give freed pages back at once), which is then
//! left as set.
//!
//! Not here: reading the counters (`heap`), the cap it enforces (`cap`).

use super::cap::check_cap;
use super::heap::{CURRENT, PEAK, WINDOW_PEAK};
use mimalloc::MiMalloc;
use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::Ordering;

/// A global allocator (mimalloc underneath) that counts live and peak heap bytes.
pub struct CountingAlloc;

fn grow(n: u64) {
    let now = CURRENT.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
    WINDOW_PEAK.fetch_max(now, Ordering::Relaxed);
}

fn shrink(n: u64) {
    CURRENT.fetch_sub(n, Ordering::Relaxed);
}

/// mimalloc's `mi_option_purge_delay` (15 in mimalloc 2 and 3): -1 never purges.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
static CONFIGURED: std::sync::Once = std::sync::Once::new();

/// Keeps freed pages mapped and committed (see the module's documentation) unless
/// `MIMALLOC_PURGE_DELAY` says otherwise; before the first allocation, as mimalloc reads its
/// options once.
fn configure() {
    // SAFETY: reads the environment and sets a process-wide option; neither allocates (this
    // runs inside the allocator, where `std::env` would allocate and re-enter it).
    CONFIGURED.call_once(|| unsafe {
        if libc::getenv(c"MIMALLOC_PURGE_DELAY".as_ptr()).is_null() {
            libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1)
        }
    });
}

// SAFETY: every method hands its arguments unchanged to mimalloc's `GlobalAlloc` and returns what
// it returns, so the contract holds as it holds for mimalloc: a pointer given back here (to
// `dealloc`, `realloc`) was allocated by mimalloc with that layout, since this allocator allocates
// only through it. What it adds does not break it: the counters are atomics updated after a
// successful call (no lock, no allocation), `configure` allocates nothing, and `check_cap` either
// returns or ends the process without unwinding.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        check_cap(layout.size());
        configure();
        let p = MiMalloc.alloc(layout);
        if !p.is_null() {
            grow(layout.size() as u64);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        check_cap(layout.size());
        configure();
        let p = MiMalloc.alloc_zeroed(layout);
        if !p.is_null() {
            grow(layout.size() as u64);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        MiMalloc.dealloc(ptr, layout);
        shrink(layout.size() as u64);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        check_cap(new_size.saturating_sub(layout.size()));
        let p = MiMalloc.realloc(ptr, layout, new_size);
        if !p.is_null() {
            shrink(layout.size() as u64);
            grow(new_size as u64);
        }
        p
    }
}
