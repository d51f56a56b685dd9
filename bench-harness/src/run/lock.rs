//! One run per results folder: an advisory lock (`flock`) on `<folder>/.lock`, held while a run
//! writes into it. A second run into the same `--out` is refused naming the process that holds
//! it; without it both resumed from one half-written `matrix.json`, timed the same configurations
//! at once and mixed their results. The kernel releases the lock when the holder ends, however it
//! ends (a `kill -9` leaves no stale lock; the file stays, ignored by git).
//!
//! Not here: what the run writes ([`crate::report::save`]).

use anyhow::{bail, Context, Result};
use std::io::Write;
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// The lock of a results folder, released when dropped.
pub struct FolderLock {
    _file: std::fs::File,
}

/// Takes the lock of `dir` (created if need be) for this process, or fails naming the process
/// that holds it.
pub fn lock(dir: &Path) -> Result<FolderLock> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(".lock");
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: `file` is open for the whole call, so its descriptor is valid; `flock` only reads
    // it and its flags.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let holder = std::fs::read_to_string(&path).unwrap_or_default();
        let holder = holder.trim();
        let holder = if holder.is_empty() { "unknown" } else { holder };
        bail!(
            "{} is in use by another bench-harness run (process {holder}): wait for it to end, \
             or give another --out",
            dir.display()
        );
    }
    file.set_len(0)?;
    write!(file, "{}", std::process::id())?;
    Ok(FolderLock { _file: file })
}
