//! A step's memory timeline: one [`Event`] each time a stage's forward, recompute or backward
//! ends, with the bytes live then and the highest since the previous event. The executor records
//! it; the activation peak, and the planner's checks, are read from it.
//!
//! Not here: the whole step's figures (`meter`), the counters read (`counter`).

use super::counter::Counter;
use serde::{Deserialize, Serialize};
use std::time::Instant;

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
