//! The bookkeeping rules of a step: what the executor ([`crate::exec`]) holds, frees and
//! recomputes when, stated once. The planner ([`crate::plan`]) predicts a step's memory by
//! replaying them on measured stage costs, so both cite them (`// Rule 3`) where they implement
//! one, and a rule changed on one side only fails `tests/schedule.rs`, which runs steps next to
//! their replay. What both sides compute alike from the graph's wiring is here (`Wiring`).
//!
//! A policy cuts the stages, in order, into segments; a cut before stage `a` starts one.
//!
//! - Rule 1: a cut before stage `a` stores every value that a stage before `a` produces and a
//!   stage at or after `a` reads (skip tensors included), detached. Graph inputs belong to the
//!   caller: never stored, copied or freed (`Wiring::stored_at`).
//! - Rule 2: every segment but the last runs forward once without stage graphs: its stages'
//!   outputs keep their candle op graph, so the whole segment stays alive until its last stage
//!   has run; then only the values it stores remain.
//! - Rule 3: the last segment's forward builds the stage graphs its backward uses; every other
//!   segment is recomputed, with graphs, right before its backward. A step runs every stage's
//!   forward, then segment by segment, last first, its recompute (stages in order) and its
//!   backward (stages last first).
//! - Rule 4: a stage graph reads the float values it consumes as `Var`s over their memory (graph
//!   inputs and integer values as they are): one `Var` of a value per segment, made by its first
//!   reader there and shared with its later readers there, so that the value lives until that
//!   first reader's backward. With `patched-candle`, a `Var` shares its value's storage
//!   (`Var::sharing`): it costs no bytes while the value is held anyway, as a value produced in
//!   the same segment is (its producer's run holds it until the producer's backward, after its
//!   readers') and a stored value an earlier segment takes over is (stored until then). On
//!   candle as published (`VARS_COPY`), a stored value is a variable from its cut on (Rule 1's
//!   store copies it once, while its segment's run still holds the original), which its readers
//!   read as it is; a value produced in the same segment is copied by its first reader's `Var`.
//! - Rule 5: a stored value is released when the earliest segment that reads it
//!   (`Wiring::first_reader`) builds its graphs. If that is its producer's segment, it goes
//!   before the recompute, which makes it anew. Otherwise that segment takes the stored tensor
//!   over, and from its first reader there on its `Var` (Rule 4) is what holds it.
//! - Rule 6: in backward, a stage's run (its graph, its outputs, the copies it alone still holds)
//!   is dropped as soon as its backward has run.
//! - Rule 7: a value's gradient is held from the backward of its last reader until its
//!   producer's backward takes it up, its readers' contributions summed as they come. Float
//!   values only, graph inputs excepted: only Rule 4 `Var`s get gradients.
//! - Rule 8: a parameter's gradient appears at the backward of the last stage that uses it and is
//!   held to the end of the step; earlier users add to it in place. When micro-batches
//!   accumulate, the earlier ones' sum is held throughout, and a parameter several stages use
//!   keeps this micro-batch's partial sum aside from its last user's backward to its first
//!   user's (a profile lists those parameters: `Profile::shared_grads`). With the optimizer
//!   inside backward, a gradient is complete after the backward of the earliest stage whose
//!   outputs depend on its parameter (the first step's forward finds it), reported then and
//!   freed by the caller: only the shared parameters' partial sums stay held across stages.
//! - Rule 9: the timeline records one event as each stage's forward, recompute or backward ends
//!   (after Rule 6's drop): the heap, and the bytes of the parameter gradients held. The
//!   planner's [`crate::plan::Point`]s predict them.
//! - Rule 10: under `+keep=` (selective recompute, [`crate::keep`]), every segment but the last
//!   keeps the outputs of the named ops from its forward (while the forward runs, their op graph
//!   holds them anyway), held until its recompute replays each in its op's place: the copy joins
//!   the stage's graph as the kept output goes. A replayed op is not computed again.
//! - Rule 11: under `+units=K` ([`crate::Policy::Units`]) a segment's stages are cut, in order,
//!   into backward units of K stages (the last may be shorter); Rules 4, 6 and 9 apply to a
//!   unit as they do to a stage. A unit's graphs read the float values its own stages produce as
//!   they are (no `Var`: on candle as published, no copy) and the others through `Var`s (Rule 4,
//!   made by the first reader outside the producer's unit); its backward is one candle backward
//!   from the loss and the seeds of all its stages' outputs, which holds every stage of the unit
//!   until it returns; the unit is then dropped, and its stages' events are recorded after it,
//!   last stage first, each once the gradients complete after that stage are reported.

use crate::graph::ValueId;
use std::ops::Range;

/// Whether a stage graph's `Var` over a value produced in its own segment is a copy (Rule 4):
/// on candle as published, which has no variable over another tensor's memory.
pub(crate) const VARS_COPY: bool = cfg!(not(feature = "patched-candle"));

/// Rule 11: the backward units of a segment's `stages`, `size` stages each (the last may be
/// shorter), in order.
pub(crate) fn units(
    stages: Range<usize>,
    size: usize,
) -> impl DoubleEndedIterator<Item = Range<usize>> {
    let end = stages.end;
    stages.step_by(size).map(move |start| start..(start + size).min(end))
}

/// Who produces and who reads each value: what the rules are stated over. Built from every
/// stage's inputs and outputs in stage order, from a graph's nodes (the executor) or a profile's
/// stages (the planner).
pub(crate) struct Wiring {
    /// Producing stage of every value (`None`: a graph input).
    producer: Vec<Option<usize>>,
    /// Reading stages of every value, in order.
    readers: Vec<Vec<usize>>,
}

impl Wiring {
    /// `stages`: each stage's inputs and outputs, in order; `n_values` counts the graph inputs.
    pub(crate) fn new<'a>(
        n_values: usize,
        stages: impl IntoIterator<Item = (&'a [ValueId], &'a [ValueId])>,
    ) -> Self {
        let mut producer = vec![None; n_values];
        let mut readers = vec![Vec::new(); n_values];
        for (i, (inputs, outputs)) in stages.into_iter().enumerate() {
            outputs.iter().for_each(|&v| producer[v] = Some(i));
            inputs.iter().for_each(|&v| readers[v].push(i));
        }
        Wiring { producer, readers }
    }

    pub(crate) fn n_values(&self) -> usize {
        self.producer.len()
    }

    /// The stage that produces `v` (`None`: a graph input).
    pub(crate) fn producer(&self, v: ValueId) -> Option<usize> {
        self.producer[v]
    }

    /// The stages that read `v`, in order.
    pub(crate) fn readers(&self, v: ValueId) -> &[usize] {
        &self.readers[v]
    }

    /// The first stage that reads `v`: its segment is the earliest that needs `v` (Rule 5).
    pub(crate) fn first_reader(&self, v: ValueId) -> Option<usize> {
        self.readers[v].first().copied()
    }

    /// The values a cut before stage `cut` stores (Rule 1), in order.
    pub(crate) fn stored_at(&self, cut: usize) -> impl Iterator<Item = ValueId> + '_ {
        (0..self.n_values()).filter(move |&v| {
            self.producer[v].is_some_and(|p| p < cut)
                && self.readers[v].last().is_some_and(|&r| r >= cut)
        })
    }
}
