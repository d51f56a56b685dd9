//! The memory meter: exact heap bytes on the CPU, the process's peak RSS, and a per-step timeline.
//!
//! Heap figures come from [`CountingAlloc`], a global allocator that counts every byte it hands
//! out. A binary or test installs it with
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOC: remat::memory::CountingAlloc = remat::memory::CountingAlloc;
//! ```
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

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

static CURRENT: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);
/// Allocations that would take the live heap above this fail (`u64::MAX`: no cap).
static CAP: AtomicU64 = AtomicU64::new(u64::MAX);
/// Peak since the last timeline event: what happened between two events.
static WINDOW_PEAK: AtomicU64 = AtomicU64::new(0);

#[cfg(feature = "meter")]
pub use counting::CountingAlloc;

/// The counting allocator (feature `meter`): without it nothing counts, and every heap figure
/// reads zero ([`heap_meter_installed`] says which).
#[cfg(feature = "meter")]
mod counting {
    use super::{
        ACTIVITY, ACTIVITY_NAMES, ACTIVITY_STAGE, CAP, CAP_REFUSAL, CURRENT, HINT, PEAK,
        WINDOW_PEAK,
    };
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

    /// Ends the process (exit 1, after [`tell_refusal`]) if allocating `n` more bytes would take
    /// the live heap above the cap.
    fn check_cap(n: usize) {
        let (live, cap) = (CURRENT.load(Ordering::Relaxed), CAP.load(Ordering::Relaxed));
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
    fn tell_refusal(n: usize, live: u64, cap: u64) {
        use std::io::Write;
        let mut buf = [0u8; 200];
        let mut cur = std::io::Cursor::new(&mut buf[..]);
        let activity =
            ACTIVITY_NAMES.get(ACTIVITY.load(Ordering::Relaxed) as usize).unwrap_or(&"?");
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
}

/// Makes allocations fail once the live heap would exceed `bytes`, so a CPU run can emulate a
/// smaller memory. The process then ends with exit 1 after one line on stderr naming the
/// allocation and what the process was doing ([`CAP_REFUSAL`]), as an out-of-memory error would
/// end it: returning the failure to Rust would abort (SIGABRT, exit 134, and its own message),
/// and stable Rust has no way to turn it into an error.
pub fn set_heap_cap(bytes: u64) {
    CAP.store(bytes, Ordering::Relaxed);
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

static ACTIVITY: std::sync::atomic::AtomicU8 =
    std::sync::atomic::AtomicU8::new(Activity::Setup as u8);
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

/// The heap cap now.
pub fn heap_cap() -> u64 {
    CAP.load(Ordering::Relaxed)
}

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

/// Bytes from a size like `24GiB`, `512MiB`, `1.5GB` or `1000000` (binary and decimal units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a size like 24GiB, 512MiB or 1000000"))?;
    let mult = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1u64,
        "kib" | "k" => 1 << 10,
        "mib" | "m" => 1 << 20,
        "gib" | "g" => 1 << 30,
        "kb" => 1000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        _ => {
            return Err(format!(
                "unknown unit `{unit}` in `{s}`; use B, KiB, MiB, GiB, KB, MB or GB"
            ))
        }
    };
    let bytes = n * mult as f64;
    if n.is_nan() || bytes < 1.0 || !n.is_finite() {
        return Err(format!("`{s}` is not a positive size"));
    }
    // A conversion to u64 saturates: a larger size would be taken as another, silently.
    if bytes >= u64::MAX as f64 {
        return Err(format!("`{s}` is more than a size can be ({} bytes)", u64::MAX));
    }
    Ok(bytes as u64)
}

/// A byte count as [`parse_size`] reads it back: whole GiB/MiB/KiB where exact, else bytes.
pub fn format_size(bytes: u64) -> String {
    match bytes {
        b if b > 0 && b % (1 << 30) == 0 => format!("{}GiB", b >> 30),
        b if b > 0 && b % (1 << 20) == 0 => format!("{}MiB", b >> 20),
        b if b > 0 && b % (1 << 10) == 0 => format!("{}KiB", b >> 10),
        b => b.to_string(),
    }
}

/// Whether [`CountingAlloc`] is the global allocator of this process (otherwise it has counted
/// nothing: the Rust runtime allocates before `main`, so an installed meter is never at zero).
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
fn take_window_peak() -> u64 {
    WINDOW_PEAK.swap(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed)
}

/// Resident-set figures of this process from `/proc` (Linux); `None` elsewhere.
pub mod rss {
    fn status_kib(field: &str) -> Option<u64> {
        let s = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = s.lines().find(|l| l.starts_with(field))?;
        line[field.len()..].trim().trim_end_matches("kB").trim().parse().ok()
    }

    /// Bytes of the device's memory pool in use, where the build can read it.
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
    // SAFETY: getrusage writes the whole struct when it returns 0.
    (unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } == 0)
        .then(|| unsafe { usage.assume_init() }.ru_minflt as u64)
}

/// Where a step's memory is counted: the host heap (CPU, through [`CountingAlloc`]) or the
/// default memory pool of a CUDA device, from which candle allocates (`cuMemAllocAsync`).
#[derive(Clone, Debug)]
pub enum Counter {
    /// The host heap, through [`CountingAlloc`] (feature `meter`).
    Heap,
    #[cfg(feature = "cuda")]
    Cuda(cuda::Pool),
}

impl Counter {
    /// The counter for tensors on `device`: the heap for the CPU, the device's pool otherwise.
    pub fn for_device(device: &candle_core::Device) -> Self {
        match device {
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(d) => {
                cuda::Pool::of(d).map(Counter::Cuda).unwrap_or(Counter::Heap)
            }
            _ => Counter::Heap,
        }
    }

    /// Live bytes.
    pub fn current(&self) -> u64 {
        match self {
            Counter::Heap => heap_current(),
            #[cfg(feature = "cuda")]
            Counter::Cuda(p) => p.used(),
        }
    }

    /// The bytes this counter sees a tensor hold: its elements, and on the heap candle's record
    /// of it besides ([`tensor_overhead`]), which a GPU pool does not count.
    pub fn held_bytes(&self, t: &candle_core::Tensor) -> u64 {
        match self {
            Counter::Heap => tensor_bytes(t) + tensor_overhead(),
            #[cfg(feature = "cuda")]
            Counter::Cuda(_) => tensor_bytes(t),
        }
    }

    /// Highest live bytes since the last [`Counter::reset_peak`].
    pub fn peak(&self) -> u64 {
        match self {
            Counter::Heap => heap_peak(),
            #[cfg(feature = "cuda")]
            Counter::Cuda(p) => p.peak(),
        }
    }

    /// Starts a new peak at the bytes in use now.
    pub fn reset_peak(&self) {
        match self {
            Counter::Heap => reset_heap_peak(),
            #[cfg(feature = "cuda")]
            Counter::Cuda(p) => p.reset_peak(),
        }
    }

    /// Highest live bytes since the previous call, then starts a new window.
    pub(crate) fn take_window_peak(&self) -> u64 {
        match self {
            Counter::Heap => take_window_peak(),
            #[cfg(feature = "cuda")]
            Counter::Cuda(p) => p.take_window_peak(),
        }
    }

    /// Waits for queued device work, so that times and memory readings are the step's own.
    pub fn synchronize(&self) {
        #[cfg(feature = "cuda")]
        if let Counter::Cuda(p) = self {
            p.synchronize();
        }
    }

    /// Bytes the device has reserved beyond what is live (CUDA pool only).
    pub fn reserved(&self) -> Option<u64> {
        match self {
            Counter::Heap => None,
            #[cfg(feature = "cuda")]
            Counter::Cuda(p) => Some(p.reserved()),
        }
    }
}

#[cfg(feature = "cuda")]
pub mod cuda {
    //! The CUDA pool meter: `CU_MEMPOOL_ATTR_USED_MEM_*` of the device's default memory pool.
    //! The pool has one high-water mark; the timeline resets it at every event, so the step's
    //! peak is kept here as the maximum of the windows.

    use candle_core::cuda_backend::cudarc::driver::sys;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    static STEP_PEAK: AtomicU64 = AtomicU64::new(0);

    #[derive(Clone, Debug)]
    pub struct Pool {
        pool: PoolHandle,
        stream: Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
    }

    #[derive(Clone, Copy, Debug)]
    struct PoolHandle(sys::CUmemoryPool);
    // A pool handle is a process-wide driver object; the driver API is thread-safe.
    unsafe impl Send for PoolHandle {}
    unsafe impl Sync for PoolHandle {}

    impl Pool {
        pub fn of(device: &candle_core::CudaDevice) -> Option<Self> {
            let stream = device.cuda_stream();
            let ctx = stream.context();
            ctx.bind_to_thread().ok()?;
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            let rc = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) };
            (rc == sys::CUresult::CUDA_SUCCESS).then_some(Pool { pool: PoolHandle(pool), stream })
        }

        fn get(&self, attr: sys::CUmemPool_attribute) -> u64 {
            let mut v: u64 = 0;
            unsafe {
                sys::cuMemPoolGetAttribute(
                    self.pool.0,
                    attr,
                    &mut v as *mut u64 as *mut std::ffi::c_void,
                )
            };
            v
        }

        fn reset_high(&self) {
            let mut zero: u64 = 0;
            let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
            unsafe {
                sys::cuMemPoolSetAttribute(
                    self.pool.0,
                    attr,
                    &mut zero as *mut u64 as *mut std::ffi::c_void,
                )
            };
        }

        pub fn used(&self) -> u64 {
            self.get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
        }

        pub fn reserved(&self) -> u64 {
            self.get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
        }

        pub fn peak(&self) -> u64 {
            STEP_PEAK
                .load(Ordering::Relaxed)
                .max(self.get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH))
        }

        pub fn reset_peak(&self) {
            self.reset_high();
            STEP_PEAK.store(self.used(), Ordering::Relaxed);
        }

        pub fn take_window_peak(&self) -> u64 {
            let w = self.get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH);
            STEP_PEAK.fetch_max(w, Ordering::Relaxed);
            self.reset_high();
            w
        }

        pub fn synchronize(&self) {
            let _ = self.stream.synchronize();
        }
    }
}

/// Memory and time of one measured region (usually a training step). "Heap" is the device's
/// memory: the host heap on the CPU, the memory pool on a GPU (see [`Counter`]).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Usage {
    /// Bytes live when the region started (model state, optimizer state, data).
    pub heap_base: u64,
    /// Highest bytes above `heap_base` during the region.
    pub heap_peak_delta: u64,
    /// Highest RSS during the region minus RSS at its start; `None` where `/proc` is missing.
    pub rss_peak_delta: Option<u64>,
    /// Wall-clock time from the start, in milliseconds.
    pub elapsed_ms: f64,
}

/// Measures one region on one device: created at its start, [`Meter::finish`]ed at its end.
pub struct Meter {
    counter: Counter,
    start: Instant,
    heap_base: u64,
    rss_base: Option<u64>,
}

impl Meter {
    /// Starts measuring the memory of tensors on `device` (the peak is reset).
    pub fn start(device: &candle_core::Device) -> Self {
        let counter = Counter::for_device(device);
        counter.synchronize();
        counter.reset_peak();
        let rss_base = if rss::reset_peak() { rss::current() } else { None };
        Meter { heap_base: counter.current(), counter, start: Instant::now(), rss_base }
    }

    /// The heap when the meter started.
    pub fn heap_base(&self) -> u64 {
        self.heap_base
    }

    /// Highest bytes above the start so far (e.g. after backward, before the optimizer).
    pub fn peak_so_far(&self) -> u64 {
        self.counter.synchronize();
        self.counter.peak().saturating_sub(self.heap_base)
    }

    /// Stops measuring: what was in use at the start, at the peak and now.
    pub fn finish(self) -> Usage {
        self.counter.synchronize();
        let elapsed_ms = self.start.elapsed().as_secs_f64() * 1e3;
        let rss_peak_delta = self.rss_base.zip(rss::peak()).map(|(b, p)| p.saturating_sub(b));
        let heap_peak_delta = self.counter.peak().saturating_sub(self.heap_base);
        Usage { heap_base: self.heap_base, heap_peak_delta, rss_peak_delta, elapsed_ms }
    }
}

/// Which pass of a step an event ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// A stage's forward.
    Forward,
    /// A stage's recompute before its backward.
    Recompute,
    /// A stage's backward.
    Backward,
}

/// One point of a step's memory timeline, taken when a stage (or a segment's backward) ends.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Event {
    /// The pass that ended.
    pub phase: Phase,
    /// The stage whose forward, recompute or backward just ended.
    pub stage: usize,
    /// Milliseconds from the timeline's start.
    pub at_ms: f64,
    /// Live heap bytes at this point.
    pub bytes: u64,
    /// Highest live heap bytes since the previous event.
    pub window_peak: u64,
    /// Bytes of parameter gradients the step's gradient store holds at this point.
    pub grad_bytes: u64,
}

/// The memory timeline of one step, recorded by the executor.
#[derive(Clone, Debug, Serialize)]
pub struct Timeline {
    #[serde(skip)]
    counter: Counter,
    #[serde(skip)]
    start: Instant,
    /// The events, in the order they happened.
    pub events: Vec<Event>,
}

impl Timeline {
    /// A timeline of tensors on `device`, starting now.
    pub fn start(device: &candle_core::Device) -> Self {
        let counter = Counter::for_device(device);
        counter.take_window_peak();
        Timeline { counter, start: Instant::now(), events: Vec::new() }
    }

    /// Records that stage `stage`'s `phase` ended, with `grad_bytes` of parameter gradients held
    /// (Rule 9).
    pub fn record(&mut self, phase: Phase, stage: usize, grad_bytes: u64) {
        // On a GPU the readings mean something only once the queued work has run.
        self.counter.synchronize();
        let at_ms = self.start.elapsed().as_secs_f64() * 1e3;
        let (bytes, window_peak) = (self.counter.current(), self.counter.take_window_peak());
        self.events.push(Event { phase, stage, at_ms, bytes, window_peak, grad_bytes });
    }

    /// The activation peak: the highest heap bytes of any window less the parameter gradients
    /// held at its end, above `base` (the heap before the step). Parameter gradients are state the
    /// optimizer needs whatever the policy; activations are what checkpointing acts on.
    pub fn activation_peak(&self, base: u64) -> u64 {
        self.events
            .iter()
            .map(|e| e.window_peak.saturating_sub(e.grad_bytes).saturating_sub(base))
            .max()
            .unwrap_or(0)
    }
}
