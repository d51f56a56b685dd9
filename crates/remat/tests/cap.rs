//! An allocation beyond the heap cap ends the process with exit 1 after one line that names it
//! (and the hint set for the phase), as an out-of-memory error would end a run. An allocator that
//! returned null instead would make Rust abort: SIGABRT, exit 134, "memory allocation of N bytes
//! failed", which a trainer's user would see as a crash.

use remat::memory::{set_heap_cap, set_refusal_hint, CountingAlloc, CAP_REFUSAL};
use std::process::Command;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn an_allocation_beyond_the_cap_exits_1_naming_it() {
    if std::env::var_os("CAP_TEST_CHILD").is_some() {
        set_refusal_hint("the model does not fit: choose a smaller one (--preset)".into());
        set_heap_cap(remat::memory::heap_current() + (1 << 20));
        let big = vec![1u8; 64 << 20];
        println!("allocated {} bytes past the cap", big.len());
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "an_allocation_beyond_the_cap_exits_1_naming_it", "--nocapture"])
        .env("CAP_TEST_CHILD", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let refusal = err
        .lines()
        .find(|l| l.starts_with(CAP_REFUSAL))
        .unwrap_or_else(|| panic!("no refusal line: {err}"));
    assert!(refusal.contains(&format!("refused {} bytes", 64 << 20)), "{refusal}");
    assert!(err.contains("choose a smaller one (--preset)"), "{err}");
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("allocated"),
        "the allocation went through"
    );
}
