//! The replay: the executor's bookkeeping ([`crate::rules`]) walked over a profile, predicting a
//! step's memory event by event ([`Profile::predict`], [`Profile::timeline`]).

use super::{Breakdown, Estimate, Grads, Point, Profile};
use crate::graph::ValueId;
use crate::keep::OpSet;
use crate::memory::Phase;
use crate::policy::Policy;
use crate::rules::Wiring;
use crate::Result;
use std::collections::{BTreeSet, HashMap};
use std::ops::Range;

impl Profile {
    /// The estimate for `policy` (a fixed policy or a plan; resolve `budget=`/`auto` first).
    /// `grads`: what the step does with parameter gradients (Rule 8).
    pub fn predict_policy(&self, policy: &Policy, grads: Grads) -> Result<Estimate> {
        let segments = policy.segments_of(&self.kinds())?;
        let units = policy.units(segments.len())?;
        Ok(self.predict(&segments, &units, policy.keeps(), grads))
    }

    /// The estimate for a cut of the stages into `segments` (contiguous, in order) run backward
    /// `units[k]` stages at a time in segment `k` (Rule 11), whose recomputes replay the ops of
    /// the kinds in `keep`.
    pub fn predict(
        &self,
        segments: &[Range<usize>],
        units: &[usize],
        keep: OpSet,
        grads: Grads,
    ) -> Estimate {
        let walk = Walk::new(self, keep, grads);
        let mut past = 0;
        let mut estimate = Estimate::default();
        for (k, seg) in segments.iter().enumerate() {
            let cost = walk.estimate(seg.clone(), units[k], k + 1 == segments.len(), past);
            estimate.merge(&cost);
            past += walk.settled(seg.start, seg.end);
        }
        estimate.step_ms += self.stages.iter().map(|s| s.forward_ms + s.backward_ms).sum::<f64>();
        estimate
    }

    /// The predicted timeline of a step cut into `segments` with backward `units`: one point
    /// per event of the executor's timeline, in its order (Rule 3).
    pub fn timeline(
        &self,
        segments: &[Range<usize>],
        units: &[usize],
        keep: OpSet,
        grads: Grads,
    ) -> Vec<Point> {
        let walk = Walk::new(self, keep, grads);
        let (mut forward, mut backward) = (Vec::new(), Vec::new());
        let mut past = 0;
        for (k, seg) in segments.iter().enumerate() {
            let mut back = Vec::new();
            walk.segment(seg.clone(), units[k], k + 1 == segments.len(), past, |p| {
                if p.phase == Phase::Forward {
                    forward.push(p)
                } else {
                    back.push(p)
                }
            });
            backward.push(back);
            past += walk.settled(seg.start, seg.end);
        }
        forward.into_iter().chain(backward.into_iter().rev().flatten()).collect()
    }

    /// For each of `segments`, the backward unit size whose predicted peak is lowest
    /// (`+units=auto`; Rule 11).
    pub fn choose_units(&self, segments: &[Range<usize>], keep: OpSet, grads: Grads) -> Vec<usize> {
        let walk = Walk::new(self, keep, grads);
        let mut past = 0;
        let mut units = Vec::new();
        for (k, seg) in segments.iter().enumerate() {
            units.push(walk.best_unit(seg.clone(), k + 1 == segments.len(), past).0);
            past += walk.settled(seg.start, seg.end);
        }
        units
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
        let wiring =
            Wiring::new(p.values.len(), p.stages.iter().map(|s| (&s.inputs[..], &s.outputs[..])));
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
        self.wiring
            .stored_at(a)
            .filter(|&v| self.wiring.readers(v).last().is_some_and(|&r| r < b))
            .map(|v| self.bytes(v))
            .sum()
    }

    /// The estimate of the segment `a..b` alone, run backward `unit` stages at a time: its
    /// points' peaks and its recompute time.
    pub(super) fn estimate(
        &self,
        seg: Range<usize>,
        unit: usize,
        last: bool,
        past: u64,
    ) -> Estimate {
        let (a, b) = (seg.start, seg.end);
        let mut est = Estimate::default();
        self.segment(seg, unit, last, past, |point| est.see(&point));
        if !last {
            // Rule 10: a replayed op is not run again.
            est.recompute_ms = self.p.stages[a..b]
                .iter()
                .zip(&self.kept[a..b])
                .fold(0.0, |t, (s, k)| t + (s.forward_ms - k.1).max(0.0));
        }
        est
    }

    /// The backward unit size for the segment `seg` whose predicted peak is lowest (the smaller
    /// size on a tie), and its estimate. Units of several stages save only the `Var` copies of
    /// candle as published (Rule 11), so elsewhere every unit is one stage.
    pub(super) fn best_unit(&self, seg: Range<usize>, last: bool, past: u64) -> (usize, Estimate) {
        let n = seg.len();
        let sizes: &[usize] = if crate::rules::VARS_COPY { &[1, 2, 3, 4, n] } else { &[1] };
        let mut best: Option<(usize, Estimate)> = None;
        for &k in sizes.iter().filter(|&&k| k <= n) {
            let e = self.estimate(seg.clone(), k, last, past);
            if best.as_ref().is_none_or(|(_, b)| e.peak < b.peak) {
                best = Some((k, e));
            }
        }
        best.expect("a segment has a stage")
    }

    /// Replays the segment `seg` run backward `unit` stages at a time (`last`: the one whose
    /// graphs forward keeps), with `past` bytes of settled stored values from earlier segments:
    /// `see` gets its points, its forward first, then its recompute and backward.
    fn segment(
        &self,
        seg: Range<usize>,
        unit: usize,
        last: bool,
        past: u64,
        mut see: impl FnMut(Point),
    ) {
        let seg = SegmentWalk::new(self, seg, unit, last, past);
        let live = seg.forward(&mut see);
        seg.backward(live, &mut see);
    }
}

/// One segment's replay: what it stores, hands over to its stages' `Var`s and keeps, worked out
/// once for its forward, recompute and backward.
struct SegmentWalk<'w, 'p> {
    walk: &'w Walk<'p>,
    a: usize,
    b: usize,
    /// Stages per backward unit (Rule 11).
    unit: usize,
    /// The segment whose graphs forward keeps.
    last: bool,
    /// Bytes of the settled stored values of earlier segments.
    past: u64,
    /// Rule 10: the outputs every earlier stage kept wait for its segment's recompute, after
    /// this segment's backward; this segment's own are in its live stages while its forward runs
    /// (their op graph holds them), then held alone until each stage's recompute.
    kept_before: u64,
    /// The values stored at the segment's start.
    stored_here: Vec<ValueId>,
    /// Rule 5: the stored float values first read here, which this segment takes over when it
    /// builds graphs: each counted as stored until its first reader here, then as that reader's
    /// `Var` (Rule 4: [`SegmentWalk::vars`]), as (first reader, bytes). Integer ones stay
    /// counted as stored to the end of its backward: no `Var` takes them over, and a reader's
    /// graph may hold them until its own backward.
    handed: Vec<(usize, u64)>,
}

impl<'w, 'p> SegmentWalk<'w, 'p> {
    fn new(walk: &'w Walk<'p>, range: Range<usize>, unit: usize, last: bool, past: u64) -> Self {
        let (a, b) = (range.start, range.end);
        let stored_here: Vec<ValueId> = walk.wiring.stored_at(a).collect();
        let mut seg = SegmentWalk {
            walk,
            a,
            b,
            unit,
            last,
            past,
            kept_before: walk.kept_bytes(0..a),
            stored_here,
            handed: Vec::new(),
        };
        seg.handed = seg
            .stored_here
            .iter()
            .filter(|&&v| range.contains(&seg.first_reader(v)) && seg.float(v))
            .map(|&v| (seg.first_reader(v), walk.bytes(v)))
            .collect();
        seg
    }

    fn first_reader(&self, v: ValueId) -> usize {
        self.walk.wiring.first_reader(v).expect("a stored value has a reader")
    }

    fn float(&self, v: ValueId) -> bool {
        self.walk.p.values[v].float
    }

    /// The backward unit of stage `i` (Rule 11).
    fn unit_of(&self, i: usize) -> Range<usize> {
        self.units().find(|u| u.contains(&i)).expect("a stage of the segment")
    }

    /// The backward units, in order (Rule 11).
    fn units(&self) -> impl DoubleEndedIterator<Item = Range<usize>> {
        crate::rules::units(self.a..self.b, self.unit)
    }

    /// Bytes handed over to `Var`s by stage `i` (Rule 5).
    fn handed_by(&self, i: usize) -> u64 {
        self.handed.iter().filter(|&&(first, _)| first <= i).map(|&(_, bytes)| bytes).sum()
    }

    /// Rule 4: what stage `i` holds through the `Var`s it makes is what no one else holds: the
    /// values handed over at it. A value produced in the segment is held by its producer's run
    /// the whole time, and a stored value an earlier segment takes over stays stored until then;
    /// on candle as published, the `Var` of a value produced in the segment is a copy, made by
    /// its first reader outside its producer's backward unit (Rule 11) and held until that
    /// reader's backward.
    fn vars(&self, i: usize) -> u64 {
        let handed: u64 =
            self.handed.iter().filter(|&&(first, _)| first == i).map(|&(_, bytes)| bytes).sum();
        let wiring = &self.walk.wiring;
        let copied = |v: &&ValueId| {
            let Some(p) = wiring.producer(**v).filter(|&p| p >= self.a) else { return false };
            let own = self.unit_of(p);
            self.float(**v) && wiring.readers(**v).iter().find(|r| !own.contains(r)) == Some(&i)
        };
        let copies = if crate::rules::VARS_COPY {
            self.walk.p.stages[i].inputs.iter().filter(copied).map(|&v| self.walk.bytes(v)).sum()
        } else {
            0
        };
        handed + copies
    }

    /// Rule 8: walking backward, the gradients of later stages' parameters are in; while
    /// accumulating, the sums held throughout and the partial sums of shared parameters whose
    /// last user lies after the segment and whose first does not; with the optimizer inside
    /// backward, those partial sums alone (every other gradient was applied and freed).
    fn grads_after(&self) -> u64 {
        let (p, b) = (self.walk.p, self.b);
        self.walk.grads.held()
            + if self.walk.grads == Grads::Gathered {
                p.stages[b..].iter().map(|s| s.param_grad_bytes).sum::<u64>()
            } else {
                p.shared_grads
                    .iter()
                    .filter(|s| s.last >= b && s.first < b)
                    .map(|s| s.bytes)
                    .sum::<u64>()
            }
    }

    /// The segment's forward, stage by stage; returns what its stages hold at its end.
    fn forward(&self, see: &mut impl FnMut(Point)) -> u64 {
        // Rule 1: forward holds every value stored so far; Rule 2: a segment's stages stay until it
        // ends.
        let stored = self.past + self.stored_here.iter().map(|&v| self.walk.bytes(v)).sum::<u64>();
        let mut live = 0;
        for (i, st) in self.walk.p.stages.iter().enumerate().take(self.b).skip(self.a) {
            // Rule 3: the last segment's forward builds graphs, on `Var`s (Rule 4).
            let (keep, transient) = if self.last {
                (self.vars(i) + st.graph_bytes, st.graph_transient)
            } else {
                (st.chain_bytes, st.chain_transient)
            };
            let stored = if self.last { stored - self.handed_by(i) } else { stored };
            live += keep;
            let held = Breakdown {
                stored,
                kept: self.kept_before,
                param_grads: self.walk.grads.held(),
                value_grads: 0,
                live,
                transient: 0,
            };
            see(Point::after(Phase::Forward, i, held, transient));
        }
        live
    }

    /// The segment's recompute (but for the last segment, whose forward kept its graphs, `live`
    /// bytes) and its backward, stage by stage.
    fn backward(&self, live: u64, see: &mut impl FnMut(Point)) {
        let (walk, stages, a, b) = (self.walk, &self.walk.p.stages, self.a, self.b);
        // Rule 5: stored values whose earliest reader's segment is this one or an earlier one are
        // held (not what this segment stores: its recompute makes those anew).
        let stored = self.past
            + self
                .stored_here
                .iter()
                .filter(|&&v| self.first_reader(v) < b)
                .map(|&v| walk.bytes(v))
                .sum::<u64>();
        // Rule 7: gradients of the values later segments read, waiting for their producers.
        let mut pending: BTreeSet<ValueId> =
            walk.wiring.stored_at(b).filter(|&v| self.float(v)).collect();
        let value_grads = pending.iter().map(|&v| walk.bytes(v)).sum();
        let mut held = Breakdown {
            stored,
            kept: self.kept_before,
            param_grads: self.grads_after(),
            value_grads,
            live: 0,
            transient: 0,
        };
        if !self.last {
            // Rule 3: recomputed with graphs, right before its backward.
            for (i, st) in stages.iter().enumerate().take(b).skip(a) {
                held.live += self.vars(i) + st.graph_bytes;
                // Rule 10: a replayed output's copy joins the stage's graph as its kept one goes;
                // while the stage runs, some of its kept outputs are still held beside their
                // copies.
                let now = Breakdown {
                    stored: stored - self.handed_by(i),
                    kept: self.kept_before + walk.kept_bytes(i + 1..b),
                    ..held
                };
                see(Point::after(Phase::Recompute, i, now, st.graph_transient.max(walk.kept[i].0)));
            }
            held.kept = self.kept_before;
        } else {
            held.live = live;
        }
        // Rule 5: by its backward, what this segment took over is held by `Var`s only.
        held.stored = stored - self.handed_by(b);
        for unit in self.units().rev() {
            // Rule 11: the unit's stages are all held until its backward returns, and so are the
            // parameter gradients its later stages made and what their gradients' op graphs hold
            // (`retained`). Of a value the unit produces, its first reader's input gradient is
            // held until the producer's backward takes it up, whose own gradients then hold it
            // (`awaiting`); a later reader's adds to the sum, held to the end.
            let mut running = held;
            let (mut retained, mut awaiting) = (0, HashMap::new());
            let mut peak = Breakdown::default();
            for i in unit.clone().rev() {
                let st = &stages[i];
                // The producer's backward takes its outputs' gradients up first.
                st.outputs.iter().for_each(|v| {
                    awaiting.remove(v);
                });
                let during = Breakdown {
                    transient: st.backward_transient,
                    value_grads: running.value_grads + retained + awaiting.values().sum::<u64>(),
                    ..running
                };
                if during.total() > peak.total() {
                    peak = during;
                }
                running.param_grads += st.param_grad_bytes;
                retained += st.backward_retained;
                for (&v, &bytes) in st.inputs.iter().zip(&st.inputs_retained) {
                    let own = walk.wiring.producer(v).is_some_and(|p| unit.contains(&p));
                    if !own || awaiting.contains_key(&v) {
                        retained += bytes;
                    } else {
                        awaiting.insert(v, bytes);
                    }
                }
                // Rule 7: its outputs' gradients are taken up, its float inputs' appear.
                for v in &st.outputs {
                    if pending.remove(v) {
                        running.value_grads -= walk.bytes(*v);
                    }
                }
                for &v in st.inputs.iter().filter(|&&v| v >= walk.p.n_inputs && self.float(v)) {
                    if pending.insert(v) {
                        running.value_grads += walk.bytes(v);
                    }
                }
            }
            // Rule 6: the unit's runs go once its backward has run.
            held.live -= unit.clone().map(|i| self.vars(i) + stages[i].graph_bytes).sum::<u64>();
            held.value_grads = running.value_grads;
            let c = unit.start;
            for i in unit.clone().rev() {
                held.param_grads = self.grads_at(c, i, held.param_grads, &unit);
                let during = if i + 1 == unit.end { peak } else { held };
                see(Point { phase: Phase::Backward, stage: i, held, peak: during });
            }
        }
    }

    /// Rule 8: the parameter gradients held at the event of stage `i` of the backward unit
    /// starting at `c` (Rule 11: recorded after the whole unit's backward, once the gradients
    /// complete after `i` are reported), `before` at the event before it.
    fn grads_at(&self, c: usize, i: usize, before: u64, unit: &Range<usize>) -> u64 {
        let p = self.walk.p;
        let shared = |keep: &dyn Fn(&super::SharedGrad) -> bool| -> u64 {
            p.shared_grads.iter().filter(|s| keep(s)).map(|s| s.bytes).sum()
        };
        match self.walk.grads {
            // Every gradient the unit made stays to the end of the step.
            Grads::Gathered if i + 1 == unit.end => {
                before + unit.clone().map(|j| p.stages[j].param_grad_bytes).sum::<u64>()
            }
            Grads::Gathered => before,
            // Complete gradients join the sums in place; a shared parameter's partial sum is kept
            // aside while some of its users are before the unit.
            Grads::Accumulating(sums) => sums + shared(&|s| s.last >= c && s.first < c),
            // A gradient goes once reported: those complete after an earlier stage of the unit
            // wait.
            Grads::UpdatedInBackward => {
                let unshared = |j: usize| {
                    p.stages[j].param_grad_bytes - shared(&|s: &super::SharedGrad| s.last == j)
                };
                shared(&|s| s.last >= c && s.first < i) + (c..i).map(unshared).sum::<u64>()
            }
        }
    }
}

/// The values a cut of the stages into `segments` stores (graph inputs excluded), in order.
pub fn stored_values(profile: &Profile, segments: &[Range<usize>]) -> Vec<ValueId> {
    let walk = Walk::new(profile, OpSet::default(), Grads::Gathered);
    let mut out: Vec<ValueId> = segments
        .iter()
        .skip(1)
        .flat_map(|s| walk.wiring.stored_at(s.start).collect::<Vec<_>>())
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}
