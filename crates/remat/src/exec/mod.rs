//! The executor: forward keeping only segment boundaries, backward stage by stage.
//!
//! candle has no hook to start backprop from a given output gradient, and `backward()` needs the
//! whole forward graph alive. So each non-last segment runs forward on detached inputs and only its
//! boundary outputs are kept (detached). Backward walks the segments in reverse, recomputing each
//! (the last one keeps its forward graphs: recomputing it would buy nothing).
//!
//! Where a segment's graphs are built (its recompute, and the last segment's forward), every stage
//! runs on `Var`s over the float values it consumes (sharing their memory, not copies), so each
//! stage is a graph of its own. Backward then walks the stages in reverse: it seeds each stage's
//! outputs with their incoming gradients, calls `backward()` on that stage alone, moves the
//! parameter gradients (detached) into the step's store, passes the input gradients on and drops
//! the stage, so its activations are freed as soon as its gradients are propagated (candle's own
//! `backward()` holds every activation of the graph until it returns: a PyTorch-like peak during
//! backward needs this). Under `+units=K` the same holds of backward units of K stages instead of
//! single stages (Rule 11): a unit reads what its own stages produce without `Var`s, which on
//! candle as published are copies.
//!
//! Bit-exactness with `off` holds by construction: every policy runs the same per-stage backward
//! passes in the same order, and a recompute draws the same random keys, so only the stored
//! boundaries differ. It also equals plain candle (one `backward()` of the whole graph) where each
//! parameter is used by one op per stage: a seed's backward hands candle the incoming gradient
//! unchanged (`0 + g`, as candle itself does), and a parameter used by several stages (a tied
//! embedding) gets each stage's contribution added to the sum so far, later stages first, as candle
//! adds them. That sum is accumulated in place, so a tied vocabulary-sized weight does not need
//! three copies of its gradient at once.
//!
//! The first step also learns what later steps rely on: when each parameter's gradient is
//! complete, which variables each segment's forward changes (put back after its recompute:
//! `exec/state.rs`), and that every parameter received a gradient ([`Error::NoGradient`] otherwise).
//!
//! What a step holds, frees and recomputes when follows the rules of [`crate::rules`], which the
//! planner replays to predict it; `// Rule N` marks where each is implemented.

mod backward;
mod forward;
mod grads;
mod ops;
mod state;

pub use ops::seed;
pub(crate) use ops::var_over;

use crate::graph::{Node, StageGraph, ValueId};
use crate::keep::OpSet;
use crate::memory::Timeline;
use crate::policy::Policy;
use crate::rules::Wiring;
use crate::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, TensorId, Var};
use forward::StepRun;
use grads::{grad_bytes, ParamGrads, Reporter};
use state::StateFinder;
use std::cell::{Cell, OnceCell};
use std::collections::HashMap;
use std::ops::Range;

struct Segment {
    stages: Range<usize>,
    /// Its backward units, in order (Rule 11): one per stage but under `+units=`.
    units: Vec<Range<usize>>,
    /// Values consumed here but produced before: stored boundaries and graph inputs.
    inputs: Vec<ValueId>,
    /// Values produced here and consumed by a later segment.
    outputs: Vec<ValueId>,
    /// For each value a stage here reads, the last stage here that reads it.
    last_reader: HashMap<ValueId, usize>,
}

impl Segment {
    fn new(stages: Range<usize>, unit: usize, nodes: &[Node], wiring: &Wiring) -> Segment {
        let (mut inputs, mut last_reader) = (Vec::new(), HashMap::new());
        for i in stages.clone() {
            for &v in &nodes[i].inputs {
                last_reader.insert(v, i); // stages come in order: the last insert wins
                let produced_here = wiring.producer(v).is_some_and(|p| stages.contains(&p));
                if !produced_here && !inputs.contains(&v) {
                    inputs.push(v);
                }
            }
        }
        // Rule 1: what the cut after this segment stores, of what it produces.
        let outputs = wiring
            .stored_at(stages.end)
            .filter(|&v| wiring.producer(v).is_some_and(|p| p >= stages.start))
            .collect();
        let units = crate::rules::units(stages.clone(), unit).collect();
        Segment { stages, units, inputs, outputs, last_reader }
    }

    /// The backward unit stage `i` belongs to.
    fn unit_of(&self, i: usize) -> &Range<usize> {
        self.units.iter().find(|u| u.contains(&i)).expect("a stage of the segment")
    }
}

/// The live tensors of one stage run with a graph (or of a whole segment run without): every
/// value it touched, and the `Var`s standing in for its float inputs.
#[derive(Default)]
struct Live {
    values: HashMap<ValueId, Tensor>,
    input_vars: Vec<(ValueId, Var)>,
}

/// What one training step produced.
pub struct StepOutput {
    /// The step's loss (unscaled), detached.
    pub loss: Tensor,
    /// Gradients of the parameters (detached), keyed as candle keys them.
    pub grads: GradStore,
    /// The heap after each stage's forward, recompute and backward.
    pub timeline: Timeline,
}

impl StepOutput {
    /// The indices of `params` (the executor's, [`Executor::params`]) that received no gradient
    /// in this step: a parameter no stage reads, or one behind an op that records no backward
    /// (`candle_nn::LayerNorm::forward`, `candle_nn::ops::softmax_last_dim`), which candle drops
    /// without a word.
    pub fn params_without_grad(&self, params: &[Var]) -> Vec<usize> {
        params
            .iter()
            .enumerate()
            .filter(|(_, p)| self.grads.get(p.as_tensor()).is_none())
            .map(|(i, _)| i)
            .collect()
    }
}

/// What the first step learns about the parameters' gradients and state; later steps only read
/// it.
struct Schedule {
    /// How many stages give each parameter a gradient: a micro-batch after the first adds a
    /// parameter's gradient to the running sum once all of them are in ([`ParamGrads::add`]).
    contributions: Vec<usize>,
    /// For each parameter, the stage after whose backward its gradient is complete: the earliest
    /// whose outputs depend on it, as the first step's forward found ([`StepRun::first_users`];
    /// `None`: none does). [`Executor::accumulate_reporting`] reports it then.
    complete_after: Vec<Option<usize>>,
    /// For each segment, the variables its forward changes ([`state`]): saved before its
    /// recompute and put back after.
    changed_by: Vec<Vec<usize>>,
}

/// Runs training steps of a [`StageGraph`] under a [`Policy`].
pub struct Executor<'g> {
    graph: &'g StageGraph,
    segments: Vec<Segment>,
    /// The earliest segment that reads each value: the one that takes it over (Rule 5).
    first_consumer: Vec<Option<usize>>,
    /// The stage that produces each value (`None`: a graph input).
    producer: Vec<Option<usize>>,
    params: Vec<Var>,
    /// The ops whose outputs recomputed segments keep (selective recompute, Rule 10).
    keep: OpSet,
    seed: u64,
    replay_rng: bool,
    tell_recompute: bool,
    /// Compare each recomputed stage's outputs with its forward's ([`ops::digest`]).
    check_recompute: bool,
    /// The parameters' names, where the caller gave them ([`Executor::named`]).
    names: HashMap<TensorId, String>,
    /// Parameters meant to get no gradient ([`Executor::frozen`]).
    frozen: Vec<TensorId>,
    /// Learned by the first step, which starts from empty gradients.
    schedule: OnceCell<Schedule>,
    /// Backward starts from the loss times this (f16 loss scaling); the returned loss is unscaled.
    loss_scale: Cell<f64>,
}

impl<'g> Executor<'g> {
    /// `params` are the trainable variables whose gradients [`Executor::step`] returns.
    pub fn new(
        graph: &'g StageGraph,
        policy: &Policy,
        params: Vec<Var>,
        seed: u64,
    ) -> Result<Self> {
        let ranges = policy.segments(graph)?;
        let output = graph.output()?;
        let nodes = graph.nodes();
        if nodes.is_empty() {
            return Err(Error::Graph("the graph has no stages".into()));
        }
        let wiring =
            Wiring::new(graph.n_values(), nodes.iter().map(|n| (&n.inputs[..], &n.outputs[..])));
        let mut seg_of_stage = vec![0; nodes.len()];
        for (s, r) in ranges.iter().enumerate() {
            r.clone().for_each(|i| seg_of_stage[i] = s);
        }
        if wiring.producer(output).map(|p| seg_of_stage[p]) != Some(ranges.len() - 1) {
            return Err(Error::Graph(
                "the loss must be produced by a stage of the last segment".into(),
            ));
        }
        // Rule 5: the earliest segment that reads a value.
        let first_consumer = (0..graph.n_values())
            .map(|v| wiring.first_reader(v).map(|r| seg_of_stage[r]))
            .collect();
        let units = policy.units(ranges.len())?;
        let segments = ranges
            .into_iter()
            .zip(units)
            .map(|(stages, unit)| Segment::new(stages, unit, nodes, &wiring))
            .collect();
        let producer = (0..graph.n_values()).map(|v| wiring.producer(v)).collect();
        Ok(Executor {
            graph,
            segments,
            first_consumer,
            producer,
            params,
            keep: policy.keeps(),
            seed,
            replay_rng: true,
            tell_recompute: true,
            check_recompute: true,
            names: HashMap::new(),
            frozen: Vec::new(),
            schedule: OnceCell::new(),
            loss_scale: Cell::new(1.0),
        })
    }

    /// Switches RNG replay off: recomputes draw fresh random keys, as a checkpoint built on global
    /// RNG state would, and the recompute check with it. Exists only to show that the
    /// bit-exactness tests can fail.
    #[doc(hidden)]
    pub fn without_rng_replay(mut self) -> Self {
        self.replay_rng = false;
        self.check_recompute = false;
        self
    }

    /// Switches the recompute check off. By default the forward takes a digest of every output
    /// of every stage it will recompute (a sample of up to 1024 of its elements, spread over the
    /// tensor, and its shape), and the recompute compares: a stage that draws randomness not
    /// from its context or changes state in forward then fails the step with
    /// [`Error::Recompute`], naming it, instead of returning wrong gradients.
    pub fn without_recompute_check(mut self) -> Self {
        self.check_recompute = false;
        self
    }

    /// The parameters' names, for the errors that name one: a candle-nn user passes
    /// `&varmap.data().lock().unwrap()`. A parameter not named here is named by its place in
    /// [`Executor::params`] and its shape.
    pub fn named(mut self, names: &HashMap<String, Var>) -> Self {
        self.names = names.iter().map(|(name, v)| (v.as_tensor().id(), name.clone())).collect();
        self
    }

    /// Parameters meant to get no gradient (frozen, or trained by other means): the first step
    /// does not fail for them ([`Error::NoGradient`]).
    pub fn frozen(mut self, params: &[Var]) -> Self {
        self.frozen = params.iter().map(|v| v.as_tensor().id()).collect();
        self
    }

    /// Hides the recompute flag from the stages: a recompute then repeats the forward's side
    /// effects (BatchNorm updates its running statistics twice). Exists only for tests.
    #[doc(hidden)]
    pub fn without_recompute_flag(mut self) -> Self {
        self.tell_recompute = false;
        self
    }

    /// Loss scaling (for f16 activations, whose small gradients underflow): the following steps'
    /// backward passes start from `scale` times the loss, so every gradient they return is scaled
    /// by it too (the caller divides it out). 1 by default.
    pub fn set_loss_scale(&self, scale: f64) {
        self.loss_scale.set(scale);
    }

    /// The trainable variables whose gradients a step returns.
    pub fn params(&self) -> &[Var] {
        &self.params
    }

    /// The stage ranges the policy cut the graph into.
    pub fn segments(&self) -> Vec<Range<usize>> {
        self.segments.iter().map(|s| s.stages.clone()).collect()
    }

    /// How many stages each segment runs backward at a time (Rule 11), in order.
    pub fn units(&self) -> Vec<usize> {
        self.segments.iter().map(|s| s.units[0].len()).collect()
    }

    /// The values kept between forward and backward (the stored boundaries), graph inputs excluded.
    pub fn stored_values(&self) -> Vec<ValueId> {
        let n = self.graph.n_inputs();
        let last = self.segments.len() - 1;
        let mut v: Vec<ValueId> = self.segments[..last]
            .iter()
            .flat_map(|s| s.outputs.iter().copied())
            .filter(|&v| v >= n)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// One forward and backward pass: the loss, the parameter gradients and the memory timeline.
    /// `step` keys the random draws: use a different value for every step of a run.
    pub fn step(&self, inputs: &[Tensor], step: u64) -> Result<StepOutput> {
        self.accumulate(inputs, step, GradStore::default())
    }

    /// Gradient accumulation: one forward and backward pass of a micro-batch whose parameter
    /// gradients are added, in place, to `grads` (the sum of the earlier micro-batches' gradients,
    /// as returned by the previous call; empty for the first). The result is exactly the sum of
    /// the micro-batch gradients, `((g1 + g2) + g3) ...`, each micro-batch's gradient complete
    /// before it is added (a parameter used by several stages, a tied embedding, keeps its partial
    /// sum aside until its last stage), and no second gradient store is built. `step` keys the
    /// random draws: give every micro-batch its own.
    pub fn accumulate(&self, inputs: &[Tensor], step: u64, grads: GradStore) -> Result<StepOutput> {
        self.accumulate_reporting(inputs, step, grads, &mut |_, _| Ok(()))
    }

    /// [`Executor::accumulate`], calling `finished` during backward with the parameters (indices
    /// into [`Executor::params`]) whose gradients are complete, and the gradients so far: after
    /// each stage's backward, those no earlier stage contributes to, so that data parallelism
    /// can average them across ranks while the earlier stages run backward and recompute, and the
    /// optimizer can update them and free their gradients; at the end, the rest.
    /// Every parameter is reported once, in the same order on every step: the first step's
    /// forward finds, for each parameter, the earliest stage whose outputs depend on it (a
    /// gradient that arrives after its report is an error, never a silent partial update).
    /// `finished` may take the reported gradients out of the store (no later stage adds to them)
    /// and put them back later.
    pub fn accumulate_reporting(
        &self,
        inputs: &[Tensor],
        step: u64,
        grads: GradStore,
        finished: &mut dyn FnMut(&[usize], &mut GradStore) -> candle_core::Result<()>,
    ) -> Result<StepOutput> {
        if inputs.len() != self.graph.n_inputs() {
            return Err(Error::Inputs { expected: self.graph.n_inputs(), got: inputs.len() });
        }
        let schedule = self.schedule.get();
        // A micro-batch after the first adds complete gradients only, so it must know how many
        // contributions make one.
        let fresh = self.params.iter().all(|p| grads.get(p).is_none());
        let expected = match (fresh, schedule) {
            (true, _) => None,
            (false, Some(schedule)) => Some(&schedule.contributions[..]),
            (false, None) => return Err(Error::FirstMicroBatch),
        };
        let mut run = StepRun::start(self, inputs, step, schedule.is_none());
        let mut finder =
            schedule.is_none().then(|| StateFinder::start(&self.params)).transpose()?;
        // Rule 8: the earlier micro-batches' gradients are held throughout.
        let held = grad_bytes(&self.params, &grads);
        let (loss, kept) = run.forward(held, finder.as_mut())?;
        let first_users = run.first_users.take();
        let found = finder.map(StateFinder::finish);
        let (complete_after, changed_by) = match (schedule, &first_users, &found) {
            (Some(s), _, _) => (&s.complete_after[..], &s.changed_by[..]),
            (None, Some(users), Some(found)) => (&users[..], &found[..]),
            _ => unreachable!("the first step finds the users and the state"),
        };
        let mut sums = ParamGrads::new(grads, expected, self.params.len());
        let mut reporter = Reporter::new(finished, complete_after);
        run.backward(kept, changed_by, &mut sums, &mut reporter)?;
        let (grads, contributions) = sums.finish();
        if let (Some(complete_after), Some(changed_by)) = (first_users, found) {
            self.check_gradients(&contributions, &changed_by)?;
            let _ = self.schedule.set(Schedule { contributions, complete_after, changed_by });
        }
        Ok(StepOutput { loss, grads, timeline: run.timeline })
    }

    /// After the first step: fails naming the parameters that received no gradient (by
    /// `contributions`), but those changed in forward (state, by `changed_by`) and those the
    /// caller froze. candle drops a gradient without a word behind an op that records no backward.
    fn check_gradients(&self, contributions: &[usize], changed_by: &[Vec<usize>]) -> Result<()> {
        let state = |k: usize| changed_by.iter().any(|c| c.contains(&k));
        let mut missing: Vec<String> = self
            .params
            .iter()
            .enumerate()
            .filter(|&(k, p)| {
                contributions[k] == 0 && !state(k) && !self.frozen.contains(&p.as_tensor().id())
            })
            .map(|(k, p)| match self.names.get(&p.as_tensor().id()) {
                Some(name) => format!("`{name}`"),
                None => format!("parameter {k} {:?}", p.dims()),
            })
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        missing.sort();
        const SHOWN: usize = 8;
        let mut params = missing[..missing.len().min(SHOWN)].join(", ");
        if missing.len() > SHOWN {
            params += &format!(" and {} more", missing.len() - SHOWN);
        }
        Err(Error::NoGradient { count: missing.len(), of: self.params.len(), params })
    }
}
