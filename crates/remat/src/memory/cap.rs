//! The heap cap: a CPU run emulating a smaller memory. Allocations that would take the live heap
//! above the cap end the process with one line naming the allocation and what the process was
//! doing ([`Activity`]), and a hint naming what the user can change.
//!
//! Not here: the counting itself (`heap`, `counting`); a GPU's memory, which its own allocator
//! caps.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// Allocations that would take the live heap above this fail (`u64::MAX`: no cap).
static CAP: AtomicU64 = AtomicU64::new(u64::MAX);

/// Makes allocations fail once the live heap would exceed `bytes`, so a CPU run can emulate a
/// smaller memory. The process then ends with exit 1 after one line on stderr naming the
/// allocation and what the process was doing ([`CAP_REFUSAL`]), as an out-of-memory error would
/// end it: returning the failure to Rust would abort (SIGABRT, exit 134, and its own message),
/// and stable Rust has no way to turn it into an error.
pub fn set_heap_cap(bytes: u64) {
    CAP.store(bytes, Ordering::Relaxed);
}

/// The heap cap now.
pub fn heap_cap() -> u64 {
    CAP.load(Ordering::Relaxed)
}

/// What the process is doing, for the message of an allocation the heap cap refuses: set by the
/// executor per stage and by callers around model building, the optimizer and checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Activity {
    /// Before anything else.
    Setup,
    /// Building the model.
    Build,
    /// A stage's forward.
    Forward,
    /// A stage's recompute.
    Recompute,
    /// A stage's backward.
    Backward,
    /// The optimizer's update.
    Optimizer,
    /// A gradient check against plain candle.
    GradCheck,
}

impl Activity {
    /// The activity as a refusal names it (`forward`, `optimizer`, ...).
    pub fn name(self) -> &'static str {
        ACTIVITY_NAMES[self as usize]
    }
}

/// [`Activity::name`], by the variant's number (what [`ACTIVITY`] holds).
const ACTIVITY_NAMES: [&str; 7] =
    ["setup", "model build", "forward", "recompute", "backward", "optimizer", "gradient check"];

static ACTIVITY: AtomicU8 = AtomicU8::new(Activity::Setup as u8);
/// The stage the activity is at, or `u64::MAX` for none.
static ACTIVITY_STAGE: AtomicU64 = AtomicU64::new(u64::MAX);

/// Records what the process does from now on (see [`Activity`]).
pub fn set_activity(activity: Activity, stage: Option<usize>) {
    ACTIVITY.store(activity as u8, Ordering::Relaxed);
    ACTIVITY_STAGE.store(stage.map_or(u64::MAX, |s| s as u64), Ordering::Relaxed);
}

/// The first line of an allocation the cap refuses, which callers parse: it starts with this.
pub const CAP_REFUSAL: &str = "heap cap: refused";

/// A second line for a refusal, naming what the user can change ([`set_refusal_hint`]).
static HINT: std::sync::Mutex<&'static str> = std::sync::Mutex::new("");

/// Sets the line written after a refusal from now on, e.g. which flags make the model too large
/// while it is built ("" for none). Leaked: a hint is set a few times per process.
pub fn set_refusal_hint(hint: String) {
    let hint: &'static str = if hint.is_empty() { "" } else { Box::leak(hint.into_boxed_str()) };
    if let Ok(mut h) = HINT.lock() {
        *h = hint;
    }
}

/// Ends the process (exit 1, after [`tell_refusal`]) if allocating `n` more bytes would take
/// the live heap above the cap. Called by the counting allocator before each allocation.
#[cfg(feature = "meter")]
pub(super) fn check_cap(n: usize) {
    let (live, cap) = (super::heap::CURRENT.load(Ordering::Relaxed), CAP.load(Ordering::Relaxed));
    if live.saturating_add(n as u64) > cap {
        tell_refusal(n, live, cap);
        // SAFETY: ends the process at once, allocating nothing, running no destructor (which
        // could allocate and re-enter the refusing allocator).
        unsafe { libc::_exit(1) }
    }
}

/// Writes to stderr, without allocating (the allocator is the caller), which allocation the cap
/// refused and during what: "heap cap: refused 32768 bytes during backward (stage 3); 6291456
/// of 6291456 bytes live".
#[cfg(feature = "meter")]
fn tell_refusal(n: usize, live: u64, cap: u64) {
    use std::io::Write;
    let mut buf = [0u8; 200];
    let mut cur = std::io::Cursor::new(&mut buf[..]);
    let activity = ACTIVITY_NAMES.get(ACTIVITY.load(Ordering::Relaxed) as usize).unwrap_or(&"?");
    let _ = write!(cur, "{CAP_REFUSAL} {n} bytes during {activity}");
    let stage = ACTIVITY_STAGE.load(Ordering::Relaxed);
    if stage != u64::MAX {
        let _ = write!(cur, " (stage {stage})");
    }
    let _ = writeln!(cur, "; {live} of {cap} bytes live");
    let len = cur.position() as usize;
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(&buf[..len]);
    // `try_lock`: the refused allocation may come from a thread that holds it (it never does,
    // setting a hint allocates before locking); a hint is not worth a deadlock.
    if let Ok(hint) = HINT.try_lock() {
        if !hint.is_empty() {
            let _ = err.write_all(hint.as_bytes());
            let _ = err.write_all(b"\n");
        }
    }
}
