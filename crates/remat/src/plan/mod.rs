//! The planner: what a policy will cost before it runs, and the cheapest plan for a budget.
//!
//! - [`Profile::measure`] runs every stage once, alone, under the memory meter, as the executor
//!   runs it in each of its modes: without stage graphs (the forward of an earlier segment, whose
//!   stage outputs keep their candle op graph until the segment's boundaries are detached), with a
//!   graph on `Var`s over its inputs (the last segment and every recompute), and its backward
//!   from seeded output gradients. It records the bytes each mode leaves live and its transient
//!   peak, the bytes of every value, the parameter gradients each stage adds and the times.
//!   Stages alike ([`crate::Stage::signature`]) are measured once: a transformer's blocks cost
//!   one block's measurement and a forward each.
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

mod profile;
mod search;
mod walk;

pub use walk::stored_values;

use crate::graph::ValueId;
use crate::keep::{KeptOp, OpSet};
use crate::memory::Phase;
use crate::policy::{Policy, PolicyRequest};
use crate::stage::StageKind;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// What one stage costs, measured alone.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StageCost {
    /// The stage's name.
    pub name: String,
    /// The stage's kind, for the policies.
    pub kind: StageKind,
    /// The values it reads.
    pub inputs: Vec<ValueId>,
    /// The values it produces.
    pub outputs: Vec<ValueId>,
    /// Bytes its forward leaves live when it runs with a graph on `Var` inputs (the last segment,
    /// a recompute): its outputs and what its graph saves for backward, not its inputs' `Var`s.
    pub graph_bytes: u64,
    /// Bytes its forward leaves live without a graph of its own (an earlier segment's forward):
    /// its outputs and what their op graph references through the parameters.
    pub chain_bytes: u64,
    /// Highest bytes above what each forward leaves, while it runs (temporaries).
    pub graph_transient: u64,
    /// The highest bytes above `chain_bytes` while it runs without a graph.
    pub chain_transient: u64,
    /// Highest bytes above the heap at its start while its backward runs.
    pub backward_transient: u64,
    /// Bytes its backward holds until it returns beyond the gradients it leaves, its inputs'
    /// gradients' aside ([`StageCost::inputs_retained`]): what the gradients' op graphs
    /// reference (candle detaches a gradient only as it takes it up, and one computed by tracked
    /// ops references the gradients it was computed from; on candle as published, also the zeros
    /// each first gradient is summed into). Freed as the executor
    /// detaches the gradients after a stage's backward, or a backward unit's (Rule 11): a unit
    /// holds this of its later stages while its earlier ones run.
    #[serde(default)]
    pub backward_retained: u64,
    /// The same of its inputs' gradients, by input (what a unit holds of an input its own
    /// stages do not produce: an input they produce counts with its producer's gradients).
    #[serde(default)]
    pub inputs_retained: Vec<u64>,
    /// Bytes of the parameter gradients that appear in its backward (walking backward, a
    /// parameter several stages use counts at the last of them).
    pub param_grad_bytes: u64,
    /// Its forward's time, in milliseconds.
    pub forward_ms: f64,
    /// Its backward's time, in milliseconds.
    pub backward_ms: f64,
    /// The ops in it whose outputs a policy may keep (`+keep=`), in order: what keeping each
    /// holds, and what replaying it saves of `forward_ms`.
    #[serde(default)]
    pub keepable: Vec<KeptOp>,
}

impl StageCost {
    /// Bytes and milliseconds of the ops of a kind in `keep`.
    pub fn kept(&self, keep: OpSet) -> (u64, f64) {
        self.keepable
            .iter()
            .filter(|o| keep.contains(o.kind))
            .fold((0, 0.0), |(b, t), o| (b + o.bytes, t + o.ms))
    }
}

/// A value flowing between stages.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ValueCost {
    /// The value's bytes.
    pub bytes: u64,
    /// Float values get `Var`s and gradients; integer ones (targets, indices) do not.
    pub float: bool,
}

/// The measured costs of every stage of a graph at one batch size.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Profile {
    /// The batch size it was measured at.
    pub batch: usize,
    /// The graph's inputs: values `0..n_inputs`.
    pub n_inputs: usize,
    /// Every value's cost, by value id.
    pub values: Vec<ValueCost>,
    /// Every stage's cost, in order.
    pub stages: Vec<StageCost>,
    /// The parameters several stages give gradients to (a tied embedding).
    #[serde(default)]
    pub shared_grads: Vec<SharedGrad>,
}

/// A parameter several stages give gradients to. While micro-batches accumulate, the executor
/// keeps this micro-batch's partial sum of its gradient aside from the backward of the `last`
/// stage that uses it to that of the `first`, so that the sum over micro-batches adds complete
/// gradients (Rule 8): `bytes` more held in between.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SharedGrad {
    /// The first stage that uses it.
    pub first: usize,
    /// The last stage that uses it.
    pub last: usize,
    /// Its gradient's bytes.
    pub bytes: u64,
}

/// The parameter gradients a step holds besides the ones its backward is making (Rule 8).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Grads {
    /// One micro-batch, the optimizer after backward: each stage's gradients stay to the end.
    Gathered,
    /// A micro-batch after the first: the earlier ones' sums, these bytes, held throughout; this
    /// one's join them as they finish.
    Accumulating(u64),
    /// The optimizer inside backward: each gradient is applied and freed as soon as it is final,
    /// after the backward of the earliest stage that uses its parameter.
    UpdatedInBackward,
}

/// When the optimizer updates the parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Update {
    /// After the step's backward, from every gradient at once.
    AfterBackward,
    /// Inside backward, each parameter as soon as its gradient is final (one micro-batch).
    InBackward,
}

impl Update {
    /// As `--optimizer-in-backward` asks.
    pub fn from_flag(optimizer_in_backward: bool) -> Self {
        if optimizer_in_backward {
            Update::InBackward
        } else {
            Update::AfterBackward
        }
    }
}

impl Grads {
    /// What a step of `profile` holds: with `accumulate` micro-batches, the heaviest one (any
    /// after the first); with the update inside backward, what that frees.
    pub fn of(profile: &Profile, accumulate: usize, update: Update) -> Grads {
        match (update, accumulate > 1) {
            (Update::InBackward, _) => Grads::UpdatedInBackward,
            (Update::AfterBackward, true) => Grads::Accumulating(profile.param_grad_bytes()),
            (Update::AfterBackward, false) => Grads::Gathered,
        }
    }

    /// Bytes held from the start of the step.
    pub fn held(self) -> u64 {
        match self {
            Grads::Accumulating(bytes) => bytes,
            Grads::Gathered | Grads::UpdatedInBackward => 0,
        }
    }
}

/// What a cut of the stages into segments is predicted to cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// Highest bytes above the heap before the step (parameters, optimizer state and inputs are
    /// the caller's), forward and backward.
    pub peak: u64,
    /// The highest bytes during forward.
    pub forward_peak: u64,
    /// The highest bytes during recomputes and backward.
    pub backward_peak: u64,
    /// What the peak is made of.
    pub at_peak: Breakdown,
    /// Forward time spent again in recomputes, and the whole step's (forward, recompute,
    /// backward), in milliseconds.
    pub recompute_ms: f64,
    /// The whole step's time, in milliseconds.
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
    /// Op outputs kept for the recomputes (`+keep=`, Rule 10).
    #[serde(default)]
    pub kept: u64,
    /// Parameter gradients gathered so far (and those held from earlier micro-batches).
    pub param_grads: u64,
    /// Gradients of values waiting for their producer's backward.
    pub value_grads: u64,
    /// The live stages of the current segment, the stored values their `Var`s hold included.
    pub live: u64,
    /// The running stage's temporaries.
    pub transient: u64,
}

impl Breakdown {
    /// The sum of the parts.
    pub fn total(&self) -> u64 {
        self.stored + self.kept + self.param_grads + self.value_grads + self.live + self.transient
    }

    /// The largest part, in words.
    fn dominant(&self) -> (&'static str, u64) {
        [
            ("stored boundaries", self.stored),
            ("kept op outputs", self.kept),
            ("parameter gradients", self.param_grads),
            ("gradients in flight", self.value_grads),
            ("one segment's activations", self.live),
            ("one stage's temporaries", self.transient),
        ]
        .into_iter()
        .max_by_key(|(_, b)| *b)
        .expect("six parts")
    }
}

/// One point of a predicted step: a stage's forward, recompute or backward, as the executor's
/// timeline records it ([`crate::memory::Event`], Rule 9).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Point {
    /// The pass the event ends.
    pub phase: Phase,
    /// The stage it ends.
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
    /// Each segment's backward unit, in stages (Rule 11).
    pub units: Vec<usize>,
    /// What the plan's step is predicted to cost.
    pub estimate: Estimate,
}

impl Plan {
    /// The plan as a policy: cuts before its stages (`plan=...`), with its backward units
    /// (`+units=...`) where any has several stages.
    pub fn policy(&self) -> Policy {
        Policy::BeforeStages(self.starts[1..].to_vec()).with_units(&self.units)
    }
}

/// Why the planner found no plan.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(
        "budget {} is below the smallest peak any checkpoint plan reaches, {} (plan {plan}): the \
         state before the step (parameters, optimizer state, data, inputs) is {}, and of the \
         step's own {}, {dominant} take {}",
        mib(*.budget), mib(.fixed + .step), mib(*.fixed), mib(*.step), mib(*.dominant_bytes)
    )]
    #[allow(missing_docs)] // its fields are what its message names
    BelowMinimum {
        budget: u64,
        fixed: u64,
        step: u64,
        plan: String,
        dominant: &'static str,
        dominant_bytes: u64,
    },
    /// A stage that cannot be repeated to deepen a profile.
    #[error(
        "stage {0} cannot be repeated to deepen the profile: it must be a block of one input \
         and one output"
    )]
    Deepen(usize),
    /// Two profiles that cannot be extrapolated from.
    #[error(
        "profiles at batch {0} and {1} cannot be extrapolated: they must be of the same graph at \
         two different batch sizes"
    )]
    Extrapolate(usize, usize),
}

/// Bytes in MiB, or in KiB or bytes below a tenth of a MiB (`budget=1KiB` read "0.0 MiB").
fn mib(bytes: u64) -> String {
    match bytes {
        b if b >= (1 << 20) / 10 => format!("{:.1} MiB", crate::memory::mib(b)),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}
/// The most cut positions [`frontier`] searches (ResNet-152 has 52, a 1024-block stack 1024).
pub const FRONTIER_CUTS: usize = 64;

/// Turns `budget=`/`auto` into a [`Policy::BeforeStages`] plan for `profile`, and
/// `POLICY+units=auto` into the policy with the backward units whose peaks are lowest; a policy is
/// returned as it is. `fixed`: the heap before a step
/// (parameters, optimizer state, inputs); `available`: what `auto` may use (the device's free
/// memory less a margin, or the memory cap).
pub fn resolve(
    request: &PolicyRequest,
    profile: &Profile,
    fixed: u64,
    grads: Grads,
    available: Option<u64>,
) -> Result<(Policy, Option<Plan>)> {
    let budget = match request {
        PolicyRequest::Budget(b) => *b,
        PolicyRequest::Auto => available.ok_or(Error::NoMemoryLimit)?,
        PolicyRequest::Fixed(policy) => return Ok((policy.clone(), None)),
        PolicyRequest::ChooseUnits(policy) => {
            let segments = policy.segments_of(&profile.kinds())?;
            let units = profile.choose_units(&segments, policy.keeps(), grads);
            return Ok((policy.with_units(&units), None));
        }
    };
    let plan = profile
        .plan(budget, fixed, grads)
        .map_err(|reason| Error::Plan { policy: request.to_string(), reason: Box::new(reason) })?;
    Ok((plan.policy(), Some(plan)))
}

/// The plans for a range of budgets, from the least peak up to the peak of `off`: the memory/time
/// frontier (deduplicated: budgets that give the same plan appear once). Empty for graphs with
/// more than [`FRONTIER_CUTS`] cut positions: the search is quadratic in them and the frontier
/// runs it some fifty times (a single `budget=` plan is one search).
pub fn frontier(profile: &Profile, fixed: u64, grads: Grads, points: usize) -> Vec<Plan> {
    if profile.candidates().len() > FRONTIER_CUTS {
        return Vec::new();
    }
    let low = profile.least_peak(grads).estimate.peak;
    let high = profile.predict_policy(&Policy::Off, grads).map_or(low, |e| e.peak);
    let mut plans: Vec<Plan> = Vec::new();
    for k in 0..points.max(2) {
        let budget =
            fixed + low + (high.saturating_sub(low)) * k as u64 / (points.max(2) - 1) as u64;
        if let Ok(p) = profile.plan(budget, fixed, grads) {
            if plans.last().is_none_or(|q| (&q.starts, &q.units) != (&p.starts, &p.units)) {
                plans.push(p);
            }
        }
    }
    plans
}

/// A readable summary of a profile's stages (for `--dry-run`).
pub fn describe(profile: &Profile) -> String {
    let mut out = format!(
        "{:>4}  {:<24} {:>12} {:>12} {:>12} {:>10}\n",
        "#", "stage", "keeps", "backward+", "param grads", "forward"
    );
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
        "peak {} above the state (forward {}, backward {}): stored {}{}, parameter gradients {}, \
         gradients in flight {}, live stages {}, temporaries {}; recompute {:.0} ms of {:.0} ms \
         ({:.2}x off)",
        mib(e.peak),
        mib(e.forward_peak),
        mib(e.backward_peak),
        mib(d.stored),
        if d.kept > 0 { format!(", kept op outputs {}", mib(d.kept)) } else { String::new() },
        mib(d.param_grads),
        mib(d.value_grads),
        mib(d.live),
        mib(d.transient),
        e.recompute_ms,
        e.step_ms,
        e.time_ratio()
    )
}
