//! The replay: the executor's bookkeeping ([`crate::rules`]) walked over a profile, predicting a
//! step's memory event by event ([`Profile::predict`], [`Profile::timeline`]).

use super::{Breakdown, Estimate, Grads, Point, Profile};
use crate::graph::ValueId;
use crate::keep::OpSet;
use crate::memory::Phase;
use crate::policy::Policy;
use crate::rules::Wiring;
use crate::Result;
use std::collections::BTreeSet;
use std::ops::Range;

impl Profile {
    /// The estimate for `policy` (a fixed policy or a plan; resolve `budget=`/`auto` first).
    /// `grads`: what the step does with parameter gradients (Rule 8).
    pub fn predict_policy(&self, policy: &Policy, grads: Grads) -> Result<Estimate> {
        Ok(self.predict(&policy.segments_of(&self.kinds())?, policy.keeps(), grads))
    }

    /// The estimate for a cut of the stages into `segments` (contiguous, in order) whose
    /// recomputes replay the ops of the kinds in `keep`.
    pub fn predict(&self, segments: &[Range<usize>], keep: OpSet, grads: Grads) -> Estimate {
        let walk = Walk::new(self, keep, grads);
        let mut past = 0;
        let mut estimate = Estimate::default();
        for (k, seg) in segments.iter().enumerate() {
            let cost = walk.estimate(seg.start, seg.end, k + 1 == segments.len(), past);
            estimate.merge(&cost);
            past += walk.settled(seg.start, seg.end);
        }
        estimate.step_ms += self.stages.iter().map(|s| s.forward_ms + s.backward_ms).sum::<f64>();
        estimate
    }

    /// The predicted timeline of a step cut into `segments`: one point per event of the
    /// executor's timeline, in its order (Rule 3).
    pub fn timeline(&self, segments: &[Range<usize>], keep: OpSet, grads: Grads) -> Vec<Point> {
        let walk = Walk::new(self, keep, grads);
        let (mut forward, mut backward) = (Vec::new(), Vec::new());
        let mut past = 0;
        for (k, seg) in segments.iter().enumerate() {
            let mut back = Vec::new();
            walk.segment(seg.start, seg.end, k + 1 == segments.len(), past, |p| if p.phase == Phase::Forward { forward.push(p) } else { back.push(p) });
            backward.push(back);
            past += walk.settled(seg.start, seg.end);
        }
        forward.into_iter().chain(backward.into_iter().rev().flatten()).collect()
    }
}

impl Estimate {
    /// Takes in one point of the step.
    fn see(&mut self, point: &Point) {
        let total = point.peak.total();
        if point.phase == Phase::Forward {
            self.forward_peak = self.forward_peak.max(total);
        } else {
            self.backward_peak = self.backward_peak.max(total);
        }
        if total > self.peak {
            self.peak = total;
            self.at_peak = point.peak;
        }
    }

    pub(super) fn merge(&mut self, other: &Estimate) {
        if other.peak > self.peak {
            self.peak = other.peak;
            self.at_peak = other.at_peak;
        }
        self.forward_peak = self.forward_peak.max(other.forward_peak);
        self.backward_peak = self.backward_peak.max(other.backward_peak);
        self.recompute_ms += other.recompute_ms;
        self.step_ms += other.recompute_ms;
    }
}

/// A profile's stages and their wiring, for replaying the executor's bookkeeping
/// ([`crate::rules`]) on them.
pub(super) struct Walk<'p> {
    p: &'p Profile,
    wiring: Wiring,
    grads: Grads,
    /// Bytes each stage keeps for its recompute (Rule 10), and the time its replay saves.
    kept: Vec<(u64, f64)>,
}

impl<'p> Walk<'p> {
    pub(super) fn new(p: &'p Profile, keep: OpSet, grads: Grads) -> Self {
        let wiring = Wiring::new(p.values.len(), p.stages.iter().map(|s| (&s.inputs[..], &s.outputs[..])));
        Walk { p, wiring, grads, kept: p.stages.iter().map(|s| s.kept(keep)).collect() }
    }

    /// Bytes the stages in `range` keep (Rule 10).
    fn kept_bytes(&self, range: Range<usize>) -> u64 {
        self.kept[range].iter().map(|k| k.0).sum()
    }

    fn bytes(&self, v: ValueId) -> u64 {
        self.p.values[v].bytes
    }

    /// Bytes of the values stored at the cut `a` whose readers all lie before `b`: after the
    /// segment `a..b` they are settled (held until their earliest reader's segment takes them
    /// over, Rule 5, whatever later cuts are chosen). What the segment keeps for its recompute is
    /// not among them: every stage before a segment's start keeps its outputs (Rule 10) through
    /// that segment whatever the cuts, so [`Walk::segment`] counts those itself.
    pub(super) fn settled(&self, a: usize, b: usize) -> u64 {
        self.wiring.stored_at(a).filter(|&v| self.wiring.readers(v).last().is_some_and(|&r| r < b)).map(|v| self.bytes(v)).sum()
    }

    /// The estimate of the segment `a..b` alone: its points' peaks and its recompute time.
    pub(super) fn estimate(&self, a: usize, b: usize, last: bool, past: u64) -> Estimate {
        let mut est = Estimate::default();
        self.segment(a, b, last, past, |point| est.see(&point));
        if !last {
            // Rule 10: a replayed op is not run again.
            est.recompute_ms = self.p.stages[a..b].iter().zip(&self.kept[a..b]).fold(0.0, |t, (s, k)| t + (s.forward_ms - k.1).max(0.0));
        }
        est
    }

    /// Replays the segment `a..b` (`last`: the one whose graphs forward keeps), with `past` bytes
    /// of settled stored values from earlier segments: `see` gets its points, its forward first,
    /// then its recompute and backward.
    fn segment(&self, a: usize, b: usize, last: bool, past: u64, mut see: impl FnMut(Point)) {
        let stages = &self.p.stages;
        // Rule 10: the outputs every earlier stage kept wait for its segment's recompute, after
        // this segment's backward; this segment's own are in its live stages while its forward
        // runs (their op graph holds them), then held alone until each stage's recompute.
        let kept_before = self.kept_bytes(0..a);
        let stored_here: Vec<ValueId> = self.wiring.stored_at(a).collect();
        let first_reader = |v: ValueId| self.wiring.first_reader(v).expect("a stored value has a reader");
        let float = |v: ValueId| self.p.values[v].float;
        // Rule 5: the stored float values first read here, which this segment takes over when it
        // builds graphs: each counted as stored until its first reader here, then as that
        // reader's `Var` (Rule 4: `vars`). Integer ones stay counted as stored to the end of its
        // backward: no `Var` takes them over, and a reader's graph may hold them until its own
        // backward.
        let handed: Vec<(usize, u64)> =
            stored_here.iter().filter(|&&v| (a..b).contains(&first_reader(v)) && float(v)).map(|&v| (first_reader(v), self.bytes(v))).collect();
        let handed_by = |i: usize| handed.iter().filter(|&&(first, _)| first <= i).map(|&(_, bytes)| bytes).sum::<u64>();
        // Rule 4: what a stage holds through the `Var`s it makes is what no one else holds: the
        // values handed over at it. A value produced in the segment is held by its producer's run
        // the whole time, and a stored value an earlier segment takes over stays stored until then;
        // on candle as published, its first reader's `Var` is a copy of a value produced in the
        // segment, held until that reader's backward.
        let copied = |i: usize| -> u64 {
            let here = |v: &&ValueId| float(**v) && self.wiring.producer(**v).is_some_and(|p| p >= a) && first_reader(**v) == i;
            if crate::rules::VARS_COPY {
                stages[i].inputs.iter().filter(here).map(|&v| self.bytes(v)).sum()
            } else {
                0
            }
        };
        let vars = |i: usize| handed.iter().filter(|&&(first, _)| first == i).map(|&(_, bytes)| bytes).sum::<u64>() + copied(i);
        // Rule 8: walking backward, the gradients of later stages' parameters are in; while
        // accumulating, the sums held throughout and the partial sums of shared parameters whose
        // last user lies after the segment and whose first does not; with the optimizer inside
        // backward, those partial sums alone (every other gradient was applied and freed).
        let gathered = self.grads == Grads::Gathered;
        let grads_after: u64 = self.grads.held()
            + if gathered {
                stages[b..].iter().map(|s| s.param_grad_bytes).sum::<u64>()
            } else {
                self.p.shared_grads.iter().filter(|s| s.last >= b && s.first < b).map(|s| s.bytes).sum::<u64>()
            };

        // Rule 1: forward holds every value stored so far; Rule 2: a segment's stages stay until it ends.
        let stored = past + stored_here.iter().map(|&v| self.bytes(v)).sum::<u64>();
        let mut live = 0;
        for (i, st) in stages.iter().enumerate().take(b).skip(a) {
            // Rule 3: the last segment's forward builds graphs, on `Var`s (Rule 4).
            let (keep, transient) = if last { (vars(i) + st.graph_bytes, st.graph_transient) } else { (st.chain_bytes, st.chain_transient) };
            let stored = if last { stored - handed_by(i) } else { stored };
            live += keep;
            let held = Breakdown { stored, kept: kept_before, param_grads: self.grads.held(), value_grads: 0, live, transient: 0 };
            see(Point::after(Phase::Forward, i, held, transient));
        }

        // Rule 5: stored values whose earliest reader's segment is this one or an earlier one are
        // held (not what this segment stores: its recompute makes those anew).
        let stored = past + stored_here.iter().filter(|&&v| first_reader(v) < b).map(|&v| self.bytes(v)).sum::<u64>();
        // Rule 7: gradients of the values later segments read, waiting for their producers.
        let mut pending: BTreeSet<ValueId> = self.wiring.stored_at(b).filter(|&v| float(v)).collect();
        let value_grads = pending.iter().map(|&v| self.bytes(v)).sum();
        let mut held = Breakdown { stored, kept: kept_before, param_grads: grads_after, value_grads, live: 0, transient: 0 };
        if !last {
            // Rule 3: recomputed with graphs, right before its backward.
            for (i, st) in stages.iter().enumerate().take(b).skip(a) {
                held.live += vars(i) + st.graph_bytes;
                // Rule 10: a replayed output's copy joins the stage's graph as its kept one goes;
                // while the stage runs, some of its kept outputs are still held beside their copies.
                let now = Breakdown { stored: stored - handed_by(i), kept: kept_before + self.kept_bytes(i + 1..b), ..held };
                see(Point::after(Phase::Recompute, i, now, st.graph_transient.max(self.kept[i].0)));
            }
            held.kept = kept_before;
        } else {
            held.live = live;
        }
        // Rule 5: by its backward, what this segment took over is held by `Var`s only.
        held.stored = stored - handed_by(b);
        for i in (a..b).rev() {
            let during = Breakdown { transient: stages[i].backward_transient, ..held };
            // Rule 6: the stage's run goes once its backward has run.
            held.live -= vars(i) + stages[i].graph_bytes;
            // Rule 7: its outputs' gradients are taken up, its float inputs' appear.
            for v in &stages[i].outputs {
                if pending.remove(v) {
                    held.value_grads -= self.bytes(*v);
                }
            }
            for &v in stages[i].inputs.iter().filter(|&&v| v >= self.p.n_inputs && float(v)) {
                if pending.insert(v) {
                    held.value_grads += self.bytes(v);
                }
            }
            // Rule 8
            if gathered {
                held.param_grads += stages[i].param_grad_bytes;
            } else {
                for shared in &self.p.shared_grads {
                    if shared.last == i {
                        held.param_grads += shared.bytes;
                    }
                    if shared.first == i {
                        held.param_grads -= shared.bytes;
                    }
                }
            }
            see(Point { phase: Phase::Backward, stage: i, held, peak: during });
        }
    }
}
/// The values a cut of the stages into `segments` stores (graph inputs excluded), in order.
pub fn stored_values(profile: &Profile, segments: &[Range<usize>]) -> Vec<ValueId> {
    let walk = Walk::new(profile, OpSet::default(), Grads::Gathered);
    let mut out: Vec<ValueId> = segments.iter().skip(1).flat_map(|s| walk.wiring.stored_at(s.start).collect::<Vec<_>>()).collect();
    out.sort_unstable();
    out.dedup();
    out
}
