//! The memory and time of one measured region (usually a training step): [`Meter`] started at its
//! start, [`Usage`] when it finishes.
//!
//! Not here: the per-stage picture inside a step (`timeline`), the counters read (`counter`).

use super::counter::Counter;
use super::process::rss;
use serde::Serialize;
use std::time::Instant;

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
