//! What the kernel says about this process's memory (Linux): its resident set and the page faults
//! it has taken. Coarser than the heap counters (pages, not bytes; freed pages the allocator keeps
//! still count), but available without the counting allocator.
//!
//! Not here: the exact heap figures (`heap`), a GPU's memory (`cuda`).

/// Resident-set figures of this process from `/proc` (Linux); `None` elsewhere.
pub mod rss {
    fn status_kib(field: &str) -> Option<u64> {
        let s = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = s.lines().find(|l| l.starts_with(field))?;
        line[field.len()..].trim().trim_end_matches("kB").trim().parse().ok()
    }

    /// Resident bytes of this process now.
    pub fn current() -> Option<u64> {
        status_kib("VmRSS:").map(|k| k * 1024)
    }

    /// Peak RSS since the process started or since the last [`reset_peak`].
    pub fn peak() -> Option<u64> {
        status_kib("VmHWM:").map(|k| k * 1024)
    }

    /// Resets the kernel's peak-RSS mark to the current RSS (`clear_refs` = 5, Linux >= 4.0).
    pub fn reset_peak() -> bool {
        std::fs::write("/proc/self/clear_refs", "5").is_ok()
    }
}

/// Minor page faults this process has taken so far (`getrusage`): each one is a page the kernel
/// mapped in (and zeroed, for fresh memory) on first touch. A step that reuses the pages of the
/// last one takes none.
pub fn minor_faults() -> Option<u64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::uninit();
    // SAFETY: `usage` is valid for writes of a whole `rusage`, all getrusage asks of its pointer.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: getrusage returned 0, so it wrote the whole struct.
    Some(unsafe { usage.assume_init() }.ru_minflt as u64)
}
