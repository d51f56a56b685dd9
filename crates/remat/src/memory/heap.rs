//! The heap counters and their readings: live and peak heap bytes as [`super::CountingAlloc`]
//! counts them, the bytes a tensor takes, and measuring a region's peak.
//!
//! Not here: the allocator that moves the counters (`counting`, feature `meter`), the cap on them
//! (`cap`), the meters of a step built on them (`meter`, `timeline`).

use std::sync::atomic::{AtomicU64, Ordering};

/// Live heap bytes.
pub(super) static CURRENT: AtomicU64 = AtomicU64::new(0);
/// Highest live heap bytes since the last [`reset_heap_peak`].
pub(super) static PEAK: AtomicU64 = AtomicU64::new(0);
/// Peak since the last timeline event: what happened between two events.
pub(super) static WINDOW_PEAK: AtomicU64 = AtomicU64::new(0);

/// Bytes a tensor's elements take (its storage, if contiguous and not a view of a larger one).
pub fn tensor_bytes(t: &candle_core::Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// Heap bytes a CPU tensor of its own storage takes beyond its elements: candle's record of it
/// (id, layout with its shape and strides, op), the storage's reference count and lock. Measured
/// once on a small matrix (about 270 bytes with candle 0.11); 0 where the counting allocator is
/// not installed. The planner counts it for every parameter gradient: a deep model has
/// thousands, and without it the prediction falls short by about 1 % for `off` and 10 % for
/// `sqrt` on the depth sweep's narrow blocks, where a block's gradients are a few KB.
pub fn tensor_overhead() -> u64 {
    static OVERHEAD: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *OVERHEAD.get_or_init(|| {
        if !heap_meter_installed() {
            return 0;
        }
        // The least of a few tries: another thread allocating meanwhile only adds.
        (0..3)
            .filter_map(|_| {
                let before = heap_current();
                let t = candle_core::Tensor::zeros(
                    (2, 2),
                    candle_core::DType::F32,
                    &candle_core::Device::Cpu,
                )
                .ok()?;
                let held = heap_current().checked_sub(before)?.checked_sub(tensor_bytes(&t));
                drop(t);
                held
            })
            .min()
            .unwrap_or(0)
    })
}

/// Whether [`super::CountingAlloc`] is the global allocator of this process (otherwise it has
/// counted nothing: the Rust runtime allocates before `main`, so an installed meter is never at
/// zero).
pub fn heap_meter_installed() -> bool {
    CURRENT.load(Ordering::Relaxed) > 0
}

/// Live heap bytes.
pub fn heap_current() -> u64 {
    CURRENT.load(Ordering::Relaxed)
}

/// Highest live heap bytes since the last [`reset_heap_peak`].
pub fn heap_peak() -> u64 {
    PEAK.load(Ordering::Relaxed)
}

/// Starts a new peak at the live heap now (and a new timeline window).
pub fn reset_heap_peak() {
    PEAK.store(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
    WINDOW_PEAK.store(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// Runs `f`; returns its result and the highest live heap bytes above the level before it, while
/// it ran (the peak meter is reset: not for use inside a measured step).
pub fn peak_during<R>(f: impl FnOnce() -> R) -> (R, u64) {
    let before = heap_current();
    reset_heap_peak();
    let out = f();
    (out, heap_peak().saturating_sub(before))
}

/// The highest live heap bytes since the previous call, then starts a new window.
pub(super) fn take_window_peak() -> u64 {
    WINDOW_PEAK.swap(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed)
}
