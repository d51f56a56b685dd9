//! The allocator keeps freed pages for the next step (no page faults, no zeroing), unless
//! mimalloc's own `MIMALLOC_PURGE_DELAY` is set, which is then left as set: with 0, freed memory
//! goes back to the OS at once and resident memory follows the live heap.

use remat::memory::CountingAlloc;
use std::process::Command;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// The process's resident memory in KiB.
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
        .unwrap()
}

/// In the child: touches 256 MiB in 4 MiB blocks (an activation's sizes), frees them, and prints
/// how much of it stayed resident, in MiB.
fn child() {
    let before = rss_kib();
    let blocks: Vec<Vec<u8>> = (0..64).map(|_| vec![1u8; 4 << 20]).collect();
    drop(blocks);
    std::thread::sleep(std::time::Duration::from_millis(200));
    println!("{}", rss_kib().saturating_sub(before) / 1024);
}

fn resident_after_free(purge_delay: Option<&str>) -> u64 {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "freed_pages_are_kept_unless_mimalloc_is_told_to_purge", "--nocapture"])
        .env("PURGE_TEST_CHILD", "1");
    if let Some(delay) = purge_delay {
        cmd.env("MIMALLOC_PURGE_DELAY", delay);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .find_map(|l| l.trim().parse().ok())
        .unwrap_or_else(|| panic!("child printed no figure: {stdout}"))
}

#[test]
fn freed_pages_are_kept_unless_mimalloc_is_told_to_purge() {
    if std::env::var_os("PURGE_TEST_CHILD").is_some() {
        return child();
    }
    let (kept, purged) = (resident_after_free(None), resident_after_free(Some("0")));
    eprintln!(
        "resident after freeing 256 MiB: {kept} MiB kept by default, {purged} MiB with \
         MIMALLOC_PURGE_DELAY=0"
    );
    assert!(kept >= 200 && purged <= 64, "kept {kept} MiB, purged {purged} MiB");
}
