//! The CUDA pool meter: `CU_MEMPOOL_ATTR_USED_MEM_*` of the device's default memory pool, from
//! which candle allocates (`cuMemAllocAsync`). The pool has one high-water mark; the timeline
//! resets it at every event, so the step's peak is kept here as the maximum of the windows.
//!
//! Not here: the host heap's counters (`heap`); choosing between the two (`Counter`).

use candle_core::cuda_backend::cudarc::driver::sys;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

static STEP_PEAK: AtomicU64 = AtomicU64::new(0);

/// The default memory pool of a CUDA device, and the stream whose work its readings wait for.
#[derive(Clone, Debug)]
pub struct Pool {
    pool: PoolHandle,
    stream: Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
}

#[derive(Clone, Copy, Debug)]
struct PoolHandle(sys::CUmemoryPool);
// SAFETY: the handle names a process-wide driver object (a device's default pool, which lives as
// long as the process) and is never dereferenced here, only passed to the driver, whose API is
// thread-safe: using it from another thread, or from several at once, is sound.
unsafe impl Send for PoolHandle {}
// SAFETY: as for `Send`: shared access only passes the handle to the thread-safe driver API.
unsafe impl Sync for PoolHandle {}

impl Pool {
    /// The default pool of `device`, or `None` where the driver cannot give it.
    pub fn of(device: &candle_core::CudaDevice) -> Option<Self> {
        let stream = device.cuda_stream();
        let ctx = stream.context();
        ctx.bind_to_thread().ok()?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid place for the handle the driver writes, and the device is
        // the one of the context just bound to this thread.
        let rc = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) };
        (rc == sys::CUresult::CUDA_SUCCESS).then_some(Pool { pool: PoolHandle(pool), stream })
    }

    fn get(&self, attr: sys::CUmemPool_attribute) -> u64 {
        let mut v: u64 = 0;
        // SAFETY: the handle is a live pool (a device's default one is never destroyed), and
        // every attribute read here (`USED_MEM_*`, `RESERVED_MEM_*`) is a `cuuint64_t`, for
        // which `v` is a valid, aligned place of the right size.
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
        // SAFETY: the handle is a live pool (as in `get`); `USED_MEM_HIGH` is set from a
        // `cuuint64_t`, which `zero` is, and 0 is the one value it may be set to.
        unsafe {
            sys::cuMemPoolSetAttribute(
                self.pool.0,
                attr,
                &mut zero as *mut u64 as *mut std::ffi::c_void,
            )
        };
    }

    /// Bytes of the pool in use.
    pub fn used(&self) -> u64 {
        self.get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }

    /// Bytes the pool has reserved from the device, used or not.
    pub fn reserved(&self) -> u64 {
        self.get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
    }

    /// Highest bytes in use since the last [`Pool::reset_peak`], across the timeline's windows.
    pub fn peak(&self) -> u64 {
        STEP_PEAK
            .load(Ordering::Relaxed)
            .max(self.get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH))
    }

    /// Starts a new peak at the bytes in use now.
    pub fn reset_peak(&self) {
        self.reset_high();
        STEP_PEAK.store(self.used(), Ordering::Relaxed);
    }

    /// Highest bytes in use since the previous call, then starts a new window (the step's peak
    /// keeps it).
    pub fn take_window_peak(&self) -> u64 {
        let w = self.get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH);
        STEP_PEAK.fetch_max(w, Ordering::Relaxed);
        self.reset_high();
        w
    }

    /// Waits for the work queued on the device's stream.
    pub fn synchronize(&self) {
        let _ = self.stream.synchronize();
    }
}
