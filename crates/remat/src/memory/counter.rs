//! Where a step's memory is counted: the host heap on the CPU, a device's memory pool on a GPU.
//! One interface over both, which the meters of a region and of a step read.
//!
//! Not here: the counters themselves (`heap`, `cuda`); what is measured with them (`meter`,
//! `timeline`).

#[cfg(feature = "cuda")]
use super::cuda;
use super::heap::{heap_current, heap_peak, reset_heap_peak, tensor_bytes, tensor_overhead};

/// Where a step's memory is counted: the host heap (CPU, through [`super::CountingAlloc`]) or the
/// default memory pool of a CUDA device, from which candle allocates (`cuMemAllocAsync`).
#[derive(Clone, Debug)]
pub enum Counter {
    /// The host heap, through [`super::CountingAlloc`] (feature `meter`).
    Heap,
    /// The default memory pool of a CUDA device.
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
            Counter::Heap => super::heap::take_window_peak(),
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
