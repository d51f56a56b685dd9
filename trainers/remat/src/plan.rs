//! The planner: what a policy will cost before it runs, and the cheapest plan for a budget.
//!
//! - [`Profile::measure`] runs every stage once, alone, under the memory meter, as the executor
//!   runs it in each of its modes: without stage graphs (the forward of an earlier segment, whose
//!   stage outputs keep their candle op graph until the segment's boundaries are detached), with a
//!   graph on `Var` copies of its inputs (the last segment and every recompute), and its backward
//!   from seeded output gradients. It records the bytes each mode leaves live and its transient
//!   peak, the bytes of every value, the parameter gradients each stage adds and the times.
//!   Every quantity is linear in the batch, so two profiles at small batches give any batch
//!   ([`Profile::extrapolate`]): full sizes that do not fit this machine are predictable.
//! - [`Profile::predict`] replays the executor's bookkeeping ([`crate::rules`]) for a cut of the
//!   stages into segments: stored boundaries (skip tensors included: every value read in a later
//!   segment than its producer's), each segment's live stages, the value gradients in flight, the
//!   parameter gradients gathered so far. The result is the step's peak above the heap before it
//!   (the caller adds the model state) and the time spent recomputing; [`Profile::timeline`]
//!   gives the replay event by event, as the executor's timeline records the step.
//! - [`Profile::plan`] finds the segment starts with the least recompute time whose predicted
//!   peak fits a budget, by dynamic programming over the stage order: a plan's cost to come and
//!   its effect on later segments depend on earlier cuts only through the bytes of stored values
//!   all of whose readers lie before the current cut, so each cut position keeps the Pareto set of
//!   (those bytes, recompute time) and extends it segment by segment. [`resolve`] turns a
//!   `budget=`/`auto` policy into the plan.

use crate::graph::{StageGraph, ValueId};
use crate::memory::{set_activity, tensor_bytes, Activity, Counter, Phase};
use crate::policy::{Policy, PolicyRequest};
use crate::rules::Wiring;
use crate::stage::{StageCtx, StageKind};
use crate::{Error, Result};
use candle_core::{Tensor, Var};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::ops::Range;
use std::time::Instant;

/// What one stage costs, measured alone.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StageCost {
    pub name: String,
    pub kind: StageKind,
    pub inputs: Vec<ValueId>,
    pub outputs: Vec<ValueId>,
    /// Bytes its forward leaves live when it runs with a graph on `Var` inputs (the last segment,
    /// a recompute): its outputs and what its graph saves for backward, not the input copies.
    pub graph_bytes: u64,
    /// Bytes its forward leaves live without a graph of its own (an earlier segment's forward):
    /// its outputs and what their op graph references through the parameters.
    pub chain_bytes: u64,
    /// Highest bytes above what each forward leaves, while it runs (temporaries).
    pub graph_transient: u64,
    pub chain_transient: u64,
    /// Highest bytes above the heap at its start while its backward runs.
    pub backward_transient: u64,
    /// Bytes of the parameter gradients that appear in its backward (walking backward, a
    /// parameter several stages use counts at the last of them).
    pub param_grad_bytes: u64,
    pub forward_ms: f64,
    pub backward_ms: f64,
}

/// A value flowing between stages.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ValueCost {
    pub bytes: u64,
    /// Float values get `Var` copies and gradients; integer ones (targets, indices) do not.
    pub float: bool,
}

/// The measured costs of every stage of a graph at one batch size.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Profile {
    pub batch: usize,
    pub n_inputs: usize,
    pub values: Vec<ValueCost>,
    pub stages: Vec<StageCost>,
}

/// What a cut of the stages into segments is predicted to cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// Highest bytes above the heap before the step (parameters, optimizer state and inputs are
    /// the caller's), forward and backward.
    pub peak: u64,
    pub forward_peak: u64,
    pub backward_peak: u64,
    /// What the peak is made of.
    pub at_peak: Breakdown,
    /// Forward time spent again in recomputes, and the whole step's (forward, recompute,
    /// backward), in milliseconds.
    pub recompute_ms: f64,
    pub step_ms: f64,
}

impl Estimate {
    /// The step's time over the same step without recompute (`off`).
    pub fn time_ratio(&self) -> f64 {
        self.step_ms / (self.step_ms - self.recompute_ms)
    }
}

/// The parts of a predicted peak.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Breakdown {
    /// Stored segment boundaries.
    pub stored: u64,
    /// Parameter gradients gathered so far (and those held from earlier micro-batches).
    pub param_grads: u64,
    /// Gradients of values waiting for their producer's backward.
    pub value_grads: u64,
    /// The live stages of the current segment, their input copies included.
    pub live: u64,
    /// The running stage's temporaries.
    pub transient: u64,
}

impl Breakdown {
    pub fn total(&self) -> u64 {
        self.stored + self.param_grads + self.value_grads + self.live + self.transient
    }

    /// The largest part, in words.
    fn dominant(&self) -> (&'static str, u64) {
        [
            ("stored boundaries", self.stored),
            ("parameter gradients", self.param_grads),
            ("gradients in flight", self.value_grads),
            ("one segment's activations", self.live),
            ("one stage's temporaries", self.transient),
        ]
        .into_iter()
        .max_by_key(|(_, b)| *b)
        .expect("five parts")
    }
}

/// One point of a predicted step: a stage's forward, recompute or backward, as the executor's
/// timeline records it ([`crate::memory::Event`], Rule 9).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Point {
    pub phase: Phase,
    pub stage: usize,
    /// What the step holds once the stage has run, above the heap before the step: the event's
    /// `bytes` less that heap. No transient.
    pub held: Breakdown,
    /// The highest moment while it ran.
    pub peak: Breakdown,
}

impl Point {
    /// A forward or a recompute: it holds what it leaves, plus `transient` while it runs.
    fn after(phase: Phase, stage: usize, held: Breakdown, transient: u64) -> Point {
        Point { phase, stage, held, peak: Breakdown { transient, ..held } }
    }
}

/// The chosen segment starts and what they are predicted to cost.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Stage indices that start a segment (0 first).
    pub starts: Vec<usize>,
    pub estimate: Estimate,
}

impl Plan {
    pub fn policy(&self) -> Policy {
        Policy::BeforeStages(self.starts[1..].to_vec())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(
        "budget {} is below the smallest peak any checkpoint plan reaches, {} (plan {plan}): the state before the step \
         (parameters, optimizer state, data, inputs) is {}, and of the step's own {}, {dominant} take {}",
        mib(*.budget), mib(.fixed + .step), mib(*.fixed), mib(*.step), mib(*.dominant_bytes)
    )]
    BelowMinimum { budget: u64, fixed: u64, step: u64, plan: String, dominant: &'static str, dominant_bytes: u64 },
    #[error("profiles at batch {0} and {1} cannot be extrapolated: they must be of the same graph at two different batch sizes")]
    Extrapolate(usize, usize),
}

/// Bytes in MiB, or in KiB or bytes below a tenth of a MiB (`budget=1KiB` read "0.0 MiB").
fn mib(bytes: u64) -> String {
    match bytes {
        b if b >= (1 << 20) / 10 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / (1u64 << 10) as f64),
        b => format!("{b} B"),
    }
}

/// Runs `f` and returns what it gave, the bytes it left live, its peak above that and its time.
fn metered<R>(counter: &Counter, f: impl FnOnce() -> Result<R>) -> Result<(R, u64, u64, f64)> {
    counter.synchronize();
    let before = counter.current();
    counter.take_window_peak();
    let start = Instant::now();
    let out = f()?;
    counter.synchronize();
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let (after, peak) = (counter.current(), counter.take_window_peak());
    let left = after.saturating_sub(before);
    Ok((out, left, peak.saturating_sub(before).saturating_sub(left), ms))
}

impl Profile {
    /// Measures every stage of `graph` on `inputs` (a batch of `batch`); `params` are the
    /// trainable variables. Stages run in training mode with the recompute flag set, so nothing
    /// is updated (BatchNorm statistics) and dropout draws as in a step.
    pub fn measure(graph: &StageGraph, inputs: &[Tensor], params: &[Var], batch: usize, seed: u64) -> Result<Profile> {
        if inputs.len() != graph.n_inputs() {
            return Err(Error::Inputs { expected: graph.n_inputs(), got: inputs.len() });
        }
        let counter = Counter::for_device(inputs.first().map_or(&candle_core::Device::Cpu, |t| t.device()));
        let n_inputs = graph.n_inputs();
        let output = graph.output()?;
        let mut values: Vec<Option<Tensor>> = inputs.iter().cloned().map(Some).chain(std::iter::repeat(None)).take(graph.n_values()).collect();
        let mut costs: Vec<ValueCost> = vec![ValueCost { bytes: 0, float: false }; graph.n_values()];
        for (c, t) in costs.iter_mut().zip(inputs) {
            *c = ValueCost { bytes: tensor_bytes(t), float: t.dtype().is_float() };
        }
        let mut last_user = vec![None; params.len()];
        let mut param_bytes = vec![0u64; params.len()];
        let mut stages = Vec::with_capacity(graph.nodes().len());
        let last_reader = graph.last_readers();
        for (i, node) in graph.nodes().iter().enumerate() {
            let ins = node
                .inputs
                .iter()
                .map(|&v| values[v].clone().ok_or_else(|| Error::Graph(format!("value {v} was not produced"))))
                .collect::<Result<Vec<_>>>()?;
            // Each stage runs twice and every figure is the smaller of the two: a kernel's first
            // call may grow a workspace it keeps (per thread, by the size it meets), which is
            // not the stage's to keep.
            let once = || measure_stage(&counter, node, i, &ins, n_inputs, output, params, seed);
            let (outs, first, grads) = once()?;
            let (_, second, _) = once()?;
            let cost = first.least(&second);
            for (&v, t) in node.outputs.iter().zip(&outs) {
                costs[v] = ValueCost { bytes: tensor_bytes(t), float: t.dtype().is_float() };
                values[v] = Some(t.clone());
            }
            for (k, bytes) in grads {
                last_user[k] = Some(i);
                param_bytes[k] = bytes;
            }
            for &v in &node.inputs {
                if last_reader[v] == Some(i) && v >= n_inputs {
                    values[v] = None;
                }
            }
            stages.push(cost);
        }
        for (k, user) in last_user.iter().enumerate() {
            if let Some(i) = user {
                stages[*i].param_grad_bytes += param_bytes[k];
            }
        }
        set_activity(Activity::Setup, None);
        Ok(Profile { batch, n_inputs, values: costs, stages })
    }

    /// The profile at `batch` (`inputs_at(n)`: the graph inputs of a batch of `n`), measured at
    /// that batch. Stages run one at a time, so this needs one stage's memory, not a step's. A
    /// first pass is thrown away: it pays what a process allocates once and keeps (thread pools,
    /// workspaces sized by the largest product seen).
    pub fn at_batch<E: std::fmt::Display>(
        graph: &StageGraph,
        inputs_at: impl Fn(usize) -> std::result::Result<Vec<Tensor>, E>,
        params: &[Var],
        batch: usize,
        seed: u64,
    ) -> Result<Profile> {
        let inputs = inputs_at(batch).map_err(|e| Error::Data(format!("{e:#}")))?;
        Profile::measure(graph, &inputs, params, batch, seed)?;
        Profile::measure(graph, &inputs, params, batch, seed)
    }

    /// The profile at `batch` from measurements at the two smaller batches `probes`, extrapolated
    /// ([`Profile::extrapolate`]), for sizes where even one stage at the full batch is too big or
    /// too slow to run. Kept bytes are linear in the batch; some kernels' temporaries are not
    /// (candle's composed 3D convolutions chunk theirs), so extrapolated temporaries over-predict.
    pub fn extrapolated<E: std::fmt::Display>(
        graph: &StageGraph,
        inputs_at: impl Fn(usize) -> std::result::Result<Vec<Tensor>, E>,
        params: &[Var],
        probes: (usize, usize),
        batch: usize,
        seed: u64,
    ) -> Result<Profile> {
        let (one, two) = (Profile::at_batch(graph, &inputs_at, params, probes.0, seed)?, Profile::at_batch(graph, &inputs_at, params, probes.1, seed)?);
        Ok(Profile::extrapolate(&one, &two, batch)?)
    }

    /// The profile at `batch`, from profiles `a` and `b` of the same graph at two batch sizes:
    /// every quantity on the line through the two (bytes rounded, never below zero).
    pub fn extrapolate(a: &Profile, b: &Profile, batch: usize) -> std::result::Result<Profile, PlanError> {
        let same = a.batch != b.batch && a.stages.len() == b.stages.len() && a.values.len() == b.values.len();
        if !same {
            return Err(PlanError::Extrapolate(a.batch, b.batch));
        }
        let t = (batch as f64 - a.batch as f64) / (b.batch as f64 - a.batch as f64);
        let line = |x: f64, y: f64| x + (y - x) * t;
        let bytes = |x: u64, y: u64| line(x as f64, y as f64).round().max(0.0) as u64;
        let ms = |x: f64, y: f64| line(x, y).max(0.0);
        let values = a.values.iter().zip(&b.values).map(|(x, y)| ValueCost { bytes: bytes(x.bytes, y.bytes), float: x.float }).collect();
        let stages = a
            .stages
            .iter()
            .zip(&b.stages)
            .map(|(x, y)| StageCost {
                graph_bytes: bytes(x.graph_bytes, y.graph_bytes),
                chain_bytes: bytes(x.chain_bytes, y.chain_bytes),
                graph_transient: bytes(x.graph_transient, y.graph_transient),
                chain_transient: bytes(x.chain_transient, y.chain_transient),
                backward_transient: bytes(x.backward_transient, y.backward_transient),
                param_grad_bytes: x.param_grad_bytes,
                forward_ms: ms(x.forward_ms, y.forward_ms),
                backward_ms: ms(x.backward_ms, y.backward_ms),
                ..x.clone()
            })
            .collect();
        Ok(Profile { batch, n_inputs: a.n_inputs, values, stages })
    }

    pub fn kinds(&self) -> Vec<StageKind> {
        self.stages.iter().map(|s| s.kind).collect()
    }

    /// Bytes of every parameter gradient.
    pub fn param_grad_bytes(&self) -> u64 {
        self.stages.iter().map(|s| s.param_grad_bytes).sum()
    }

    /// The estimate for `policy` (a fixed policy or a plan; resolve `budget=`/`auto` first).
    /// `held_grads`: parameter gradient bytes held from the start (accumulating micro-batches
    /// after the first), which then do not grow.
    pub fn predict_policy(&self, policy: &Policy, held_grads: u64) -> Result<Estimate> {
        Ok(self.predict(&policy.segments_of(&self.kinds())?, held_grads))
    }

    /// The estimate for a cut of the stages into `segments` (contiguous, in order).
    pub fn predict(&self, segments: &[Range<usize>], held_grads: u64) -> Estimate {
        let walk = Walk::new(self, held_grads);
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
    pub fn timeline(&self, segments: &[Range<usize>], held_grads: u64) -> Vec<Point> {
        let walk = Walk::new(self, held_grads);
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

    /// Stages where a segment may start: blocks and downsampling stages (what the fixed
    /// policies cut at), and stage 0.
    fn candidates(&self) -> Vec<usize> {
        self.stages.iter().enumerate().filter(|(i, s)| *i == 0 || s.kind.is_block() || s.kind.is_downsample()).map(|(i, _)| i).collect()
    }

    /// The plan with the least recompute time whose peak, plus `fixed` (the heap before the step:
    /// parameters, optimizer state, inputs), fits `budget`; equal times go to the lower peak.
    pub fn plan(&self, budget: u64, fixed: u64, held_grads: u64) -> std::result::Result<Plan, PlanError> {
        let found = if budget >= fixed { self.search(budget - fixed, held_grads) } else { None };
        match found {
            Some(plan) => Ok(plan),
            None => {
                let min = self.least_peak(held_grads);
                let (dominant, dominant_bytes) = min.estimate.at_peak.dominant();
                Err(PlanError::BelowMinimum { budget, fixed, step: min.estimate.peak, plan: min.policy().to_string(), dominant, dominant_bytes })
            }
        }
    }

    /// The plan with the smallest predicted peak (a bisection over budgets of [`Profile::search`]).
    pub fn least_peak(&self, held_grads: u64) -> Plan {
        let all = self.stages.iter().map(|s| s.graph_bytes + s.chain_bytes + s.graph_transient + s.backward_transient).sum::<u64>()
            + self.values.iter().map(|v| 2 * v.bytes).sum::<u64>()
            + self.param_grad_bytes()
            + held_grads;
        let mut best = self.search(all, held_grads).expect("every plan fits a budget of everything at once");
        let (mut lo, mut hi) = (0u64, best.estimate.peak);
        while lo + 1 < hi {
            let mid = lo + (hi - lo) / 2;
            match self.search(mid, held_grads) {
                Some(p) => {
                    hi = p.estimate.peak.min(mid);
                    best = p;
                }
                None => lo = mid,
            }
        }
        best
    }

    /// The dynamic programme: for each candidate cut position, the Pareto set of partial plans
    /// by (bytes of stored values all of whose readers lie before the cut, recompute time).
    fn search(&self, step_budget: u64, held_grads: u64) -> Option<Plan> {
        let walk = Walk::new(self, held_grads);
        let n = self.stages.len();
        let cuts = self.candidates();
        struct Partial {
            past: u64,
            recompute: f64,
            peak: Estimate,
            starts: Vec<usize>,
        }
        let mut fronts: Vec<Vec<Partial>> = (0..cuts.len()).map(|_| Vec::new()).collect();
        fronts[0].push(Partial { past: 0, recompute: 0.0, peak: Estimate::default(), starts: vec![0] });
        let mut best: Option<Partial> = None;
        for (ia, &a) in cuts.iter().enumerate() {
            let front = std::mem::take(&mut fronts[ia]);
            for p in &front {
                for (ib, b) in cuts.iter().copied().enumerate().skip(ia + 1).map(|(i, b)| (Some(i), b)).chain(std::iter::once((None, n))) {
                    let last = ib.is_none();
                    let cost = walk.estimate(a, b, last, p.past);
                    if cost.peak > step_budget {
                        continue;
                    }
                    let mut peak = p.peak;
                    peak.merge(&cost);
                    let mut starts = p.starts.clone();
                    let next = Partial { past: p.past + walk.settled(a, b), recompute: p.recompute + cost.recompute_ms, peak, starts: Vec::new() };
                    match ib {
                        None => {
                            let better = best.as_ref().is_none_or(|q| (next.recompute, next.peak.peak) < (q.recompute, q.peak.peak));
                            if better {
                                best = Some(Partial { starts, ..next });
                            }
                        }
                        Some(ib) => {
                            let f = &mut fronts[ib];
                            let dominated = f.iter().any(|q| q.past <= next.past && q.recompute <= next.recompute && q.peak.peak <= next.peak.peak);
                            if !dominated {
                                f.retain(|q| !(next.past <= q.past && next.recompute <= q.recompute && next.peak.peak <= q.peak.peak));
                                starts.push(b);
                                f.push(Partial { starts, ..next });
                            }
                        }
                    }
                }
            }
        }
        let best = best?;
        let segments: Vec<Range<usize>> = best.starts.iter().zip(best.starts.iter().skip(1).chain(std::iter::once(&n))).map(|(&a, &b)| a..b).collect();
        Some(Plan { estimate: self.predict(&segments, held_grads), starts: best.starts })
    }
}

/// Bytes of each parameter gradient a stage's backward gives, by index in the parameter list.
type ParamGradBytes = Vec<(usize, u64)>;

/// One measurement of stage `i` of a graph on its inputs `ins`: its outputs (detached), its
/// costs, and the bytes of each parameter gradient (by index in `params`) its backward gives.
#[allow(clippy::too_many_arguments)]
fn measure_stage(
    counter: &Counter,
    node: &crate::graph::Node,
    i: usize,
    ins: &[Tensor],
    n_inputs: usize,
    output: ValueId,
    params: &[Var],
    seed: u64,
) -> Result<(Vec<Tensor>, StageCost, ParamGradBytes)> {
    let stage_err = |source| Error::Stage { stage: i, name: node.stage.name(), source };
    let ctx = || StageCtx::new(seed, 0, i, 0, true, true);
    set_activity(Activity::Forward, Some(i));
    // Without a graph of its own: the outputs keep their op graph until detached.
    let (outs, chain_bytes, chain_transient, _) = metered(counter, || node.stage.forward(ins, &ctx()).map_err(stage_err))?;
    let detached: Vec<Tensor> = outs.iter().map(Tensor::detach).collect();
    drop(outs);
    // With a graph on `Var` copies, as the executor's last segment and recomputes run it.
    let graph_ins = node
        .inputs
        .iter()
        .zip(ins)
        .map(|(&v, t)| Ok(if v >= n_inputs && t.dtype().is_float() { Some(Var::from_tensor(&t.detach())?) } else { None }))
        .collect::<Result<Vec<Option<Var>>>>()?;
    let run_ins: Vec<Tensor> = graph_ins.iter().zip(ins).map(|(var, t)| var.as_ref().map_or(t.clone(), |v| v.as_tensor().clone())).collect();
    let (outs, graph_bytes, graph_transient, forward_ms) = metered(counter, || node.stage.forward(&run_ins, &ctx()).map_err(stage_err))?;
    // Backward from the loss, or from a gradient of ones for every float output.
    let seeds = node
        .outputs
        .iter()
        .zip(&outs)
        .filter(|(&v, t)| v != output && t.dtype().is_float())
        .map(|(_, t)| Ok((t.clone(), t.ones_like()?)))
        .collect::<Result<Vec<_>>>()?;
    let loss = node.outputs.iter().position(|&v| v == output).map(|k| outs[k].clone());
    set_activity(Activity::Backward, Some(i));
    let (grads, grads_left, above_left, backward_ms) = metered(counter, || {
        let mut root = loss.clone();
        for (t, g) in seeds {
            let seeded = crate::exec::seed(&t, g)?;
            root = Some(match root {
                Some(r) => (r + seeded)?,
                None => seeded,
            });
        }
        Ok(match root {
            Some(r) => Some(r.backward()?),
            None => None,
        })
    })?;
    let param_grads = params.iter().enumerate().filter_map(|(k, p)| Some((k, counter.held_bytes(grads.as_ref()?.get(p)?)))).collect();
    set_activity(Activity::Setup, None);
    let cost = StageCost {
        name: node.stage.name(),
        kind: node.stage.kind(),
        inputs: node.inputs.clone(),
        outputs: node.outputs.clone(),
        graph_bytes,
        chain_bytes,
        graph_transient,
        chain_transient,
        // Its peak above the heap at its start: the gradients it leaves are part of it.
        backward_transient: grads_left + above_left,
        param_grad_bytes: 0,
        forward_ms,
        backward_ms,
    };
    Ok((detached, cost, param_grads))
}

impl StageCost {
    /// Every figure the smaller of two measurements of the same stage.
    fn least(&self, other: &StageCost) -> StageCost {
        StageCost {
            graph_bytes: self.graph_bytes.min(other.graph_bytes),
            chain_bytes: self.chain_bytes.min(other.chain_bytes),
            graph_transient: self.graph_transient.min(other.graph_transient),
            chain_transient: self.chain_transient.min(other.chain_transient),
            backward_transient: self.backward_transient.min(other.backward_transient),
            forward_ms: self.forward_ms.min(other.forward_ms),
            backward_ms: self.backward_ms.min(other.backward_ms),
            ..self.clone()
        }
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

    fn merge(&mut self, other: &Estimate) {
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
struct Walk<'p> {
    p: &'p Profile,
    wiring: Wiring,
    held_grads: u64,
}

impl<'p> Walk<'p> {
    fn new(p: &'p Profile, held_grads: u64) -> Self {
        let wiring = Wiring::new(p.values.len(), p.stages.iter().map(|s| (&s.inputs[..], &s.outputs[..])));
        Walk { p, wiring, held_grads }
    }

    fn bytes(&self, v: ValueId) -> u64 {
        self.p.values[v].bytes
    }

    /// Bytes of the values stored at the cut `a` whose readers all lie before `b`: after the
    /// segment `a..b` they are settled (held until their earliest reader's segment takes them
    /// over, Rule 5, whatever later cuts are chosen).
    fn settled(&self, a: usize, b: usize) -> u64 {
        self.wiring.stored_at(a).filter(|&v| self.wiring.readers(v).last().is_some_and(|&r| r < b)).map(|v| self.bytes(v)).sum()
    }

    /// The estimate of the segment `a..b` alone: its points' peaks and its recompute time.
    fn estimate(&self, a: usize, b: usize, last: bool, past: u64) -> Estimate {
        let mut est = Estimate::default();
        self.segment(a, b, last, past, |point| est.see(&point));
        if !last {
            est.recompute_ms = self.p.stages[a..b].iter().fold(0.0, |t, s| t + s.forward_ms);
        }
        est
    }

    /// Replays the segment `a..b` (`last`: the one whose graphs forward keeps), with `past` bytes
    /// of settled stored values from earlier segments: `see` gets its points, its forward first,
    /// then its recompute and backward.
    fn segment(&self, a: usize, b: usize, last: bool, past: u64, mut see: impl FnMut(Point)) {
        let stages = &self.p.stages;
        let stored_here: Vec<ValueId> = self.wiring.stored_at(a).collect();
        let first_reader = |v: ValueId| self.wiring.first_reader(v).expect("a stored value has a reader");
        let float = |v: ValueId| self.p.values[v].float;
        // Rule 5: the stored float values first read here, which this segment takes over when it
        // builds graphs: each held until its last reader here has run. Integer ones stay counted
        // as stored to the end of its backward: no copy replaces them, and a reader's graph may
        // hold them until its own backward.
        let handed: Vec<(usize, u64)> = stored_here
            .iter()
            .filter(|&&v| (a..b).contains(&first_reader(v)) && float(v))
            .map(|&v| (self.wiring.readers(v).iter().copied().take_while(|&r| r < b).last().expect("read here"), self.bytes(v)))
            .collect();
        let handed_by = |i: usize| handed.iter().filter(|&&(last, _)| last <= i).map(|&(_, bytes)| bytes).sum::<u64>();
        let copies = |i: usize| self.copies(a, i);
        // Rule 8: walking backward, the gradients of later stages' parameters are in (while
        // accumulating, `held_grads` stays as it is: the partial sums are not replayed).
        let grads_after: u64 = self.held_grads + if self.held_grads > 0 { 0 } else { stages[b..].iter().map(|s| s.param_grad_bytes).sum() };

        // Rule 1: forward holds every value stored so far; Rule 2: a segment's stages stay until it ends.
        let stored = past + stored_here.iter().map(|&v| self.bytes(v)).sum::<u64>();
        let mut live = 0;
        for (i, st) in stages.iter().enumerate().take(b).skip(a) {
            // Rule 3: the last segment's forward builds graphs, on copies (Rule 4).
            let (keep, transient) = if last { (copies(i) + st.graph_bytes, st.graph_transient) } else { (st.chain_bytes, st.chain_transient) };
            let stored = if last { stored - handed_by(i) } else { stored };
            live += keep;
            see(Point::after(Phase::Forward, i, Breakdown { stored, param_grads: self.held_grads, value_grads: 0, live, transient: 0 }, transient));
        }

        // Rule 5: stored values whose earliest reader's segment is this one or an earlier one are
        // held (not what this segment stores: its recompute makes those anew).
        let stored = past + stored_here.iter().filter(|&&v| first_reader(v) < b).map(|&v| self.bytes(v)).sum::<u64>();
        // Rule 7: gradients of the values later segments read, waiting for their producers.
        let mut pending: BTreeSet<ValueId> = self.wiring.stored_at(b).filter(|&v| float(v)).collect();
        let value_grads = pending.iter().map(|&v| self.bytes(v)).sum();
        let mut held = Breakdown { stored, param_grads: grads_after, value_grads, live: 0, transient: 0 };
        if !last {
            // Rule 3: recomputed with graphs, right before its backward.
            for (i, st) in stages.iter().enumerate().take(b).skip(a) {
                held.live += copies(i) + st.graph_bytes;
                let now = Breakdown { stored: stored - handed_by(i), ..held };
                see(Point::after(Phase::Recompute, i, now, st.graph_transient));
            }
        } else {
            held.live = live;
        }
        // Rule 5: by its backward, what this segment took over is held by copies only.
        held.stored = stored - handed_by(b);
        for i in (a..b).rev() {
            let during = Breakdown { transient: stages[i].backward_transient, ..held };
            // Rule 6: the stage's run goes once its backward has run.
            held.live -= copies(i) + stages[i].graph_bytes;
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
            if self.held_grads == 0 {
                held.param_grads += stages[i].param_grad_bytes;
            }
            see(Point { phase: Phase::Backward, stage: i, held, peak: during });
        }
    }

    /// Bytes of the `Var` copies stage `i` of the segment starting at `a` makes (Rule 4): each
    /// float value once per segment, at its first reader there.
    fn copies(&self, a: usize, i: usize) -> u64 {
        let n_inputs = self.p.n_inputs;
        let first_here = |v: ValueId| self.wiring.readers(v).iter().find(|&&r| r >= a) == Some(&i);
        self.p.stages[i].inputs.iter().filter(|&&v| v >= n_inputs && self.p.values[v].float && first_here(v)).map(|&v| self.bytes(v)).sum()
    }
}

/// The most cut positions [`frontier`] searches (ResNet-152 has 52, a 1024-block stack 1024).
pub const FRONTIER_CUTS: usize = 64;

/// Turns `budget=`/`auto` into a [`Policy::BeforeStages`] plan for `profile`; a policy is returned
/// as it is. `fixed`: the heap before a step
/// (parameters, optimizer state, inputs); `available`: what `auto` may use (the device's free
/// memory less a margin, or the memory cap).
pub fn resolve(request: &PolicyRequest, profile: &Profile, fixed: u64, held_grads: u64, available: Option<u64>) -> Result<(Policy, Option<Plan>)> {
    let budget = match request {
        PolicyRequest::Budget(b) => *b,
        PolicyRequest::Auto => available.ok_or(Error::NoMemoryLimit)?,
        PolicyRequest::Fixed(policy) => return Ok((policy.clone(), None)),
    };
    let plan = profile.plan(budget, fixed, held_grads).map_err(|reason| Error::Plan { policy: request.to_string(), reason: Box::new(reason) })?;
    Ok((plan.policy(), Some(plan)))
}

/// The plans for a range of budgets, from the least peak up to the peak of `off`: the memory/time
/// frontier (deduplicated: budgets that give the same plan appear once). Empty for graphs with
/// more than [`FRONTIER_CUTS`] cut positions: the search is quadratic in them and the frontier
/// runs it some fifty times (a single `budget=` plan is one search).
pub fn frontier(profile: &Profile, fixed: u64, held_grads: u64, points: usize) -> Vec<Plan> {
    if profile.candidates().len() > FRONTIER_CUTS {
        return Vec::new();
    }
    let low = profile.least_peak(held_grads).estimate.peak;
    let high = profile.predict_policy(&Policy::Off, held_grads).map_or(low, |e| e.peak);
    let mut plans: Vec<Plan> = Vec::new();
    for k in 0..points.max(2) {
        let budget = fixed + low + (high.saturating_sub(low)) * k as u64 / (points.max(2) - 1) as u64;
        if let Ok(p) = profile.plan(budget, fixed, held_grads) {
            if plans.last().is_none_or(|q| q.starts != p.starts) {
                plans.push(p);
            }
        }
    }
    plans
}

/// A readable summary of a profile's stages (for `--dry-run`).
pub fn describe(profile: &Profile) -> String {
    let mut out = format!("{:>4}  {:<24} {:>12} {:>12} {:>12} {:>10}\n", "#", "stage", "keeps", "backward+", "param grads", "forward");
    for (i, s) in profile.stages.iter().enumerate() {
        out += &format!(
            "{i:>4}  {:<24} {:>12} {:>12} {:>12} {:>8.1}ms\n",
            s.name,
            mib(s.graph_bytes),
            mib(s.backward_transient),
            mib(s.param_grad_bytes),
            s.forward_ms
        );
    }
    out
}

/// Every field of `e` in one line.
pub fn summary(e: &Estimate) -> String {
    let d = &e.at_peak;
    format!(
        "peak {} above the state (forward {}, backward {}): stored {}, parameter gradients {}, gradients in flight {}, live stages {}, temporaries {}; recompute {:.0} ms of {:.0} ms ({:.2}x off)",
        mib(e.peak),
        mib(e.forward_peak),
        mib(e.backward_peak),
        mib(d.stored),
        mib(d.param_grads),
        mib(d.value_grads),
        mib(d.live),
        mib(d.transient),
        e.recompute_ms,
        e.step_ms,
        e.time_ratio()
    )
}

/// The values a cut of the stages into `segments` stores (graph inputs excluded), in order.
pub fn stored_values(profile: &Profile, segments: &[Range<usize>]) -> Vec<ValueId> {
    let walk = Walk::new(profile, 0);
    let mut out: Vec<ValueId> = segments.iter().skip(1).flat_map(|s| walk.wiring.stored_at(s.start).collect::<Vec<_>>()).collect();
    out.sort_unstable();
    out.dedup();
    out
}
