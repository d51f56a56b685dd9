//! The executor: forward keeping only segment boundaries, backward stage by stage.
//!
//! candle has no hook to start backprop from a given output gradient, and `backward()` needs the
//! whole forward graph alive. So each non-last segment runs forward on detached inputs and only
//! its boundary outputs are kept (detached). Backward walks the segments in reverse, recomputing
//! each (the last one keeps its forward graphs: recomputing it would buy nothing).
//!
//! Where a segment's graphs are built (its recompute, and the last segment's forward), every
//! stage runs on `Var` copies of the float values it consumes, so each stage is a graph of its
//! own. Backward then walks the stages in reverse: it seeds each stage's outputs with their
//! incoming gradients, calls `backward()` on that stage alone, moves the parameter gradients
//! (detached) into the step's store, passes the input gradients on and drops the stage, so its
//! activations are freed as soon as its gradients are propagated (candle's own `backward()`
//! holds every activation of the graph until it returns: a PyTorch-like peak during backward
//! needs this). The price is one copy of each value that crosses a stage inside such a segment.
//!
//! Bit-exactness with `off` holds by construction: every policy runs the same per-stage backward
//! passes in the same order, and a recompute draws the same random keys, so only the stored
//! boundaries differ. It also equals plain candle (one `backward()` of the whole graph) where each
//! parameter is used by one op per stage: a seed's backward hands candle the incoming gradient
//! unchanged (`0 + g`, as candle itself does), and a parameter used by several stages (a tied
//! embedding) gets each stage's contribution added to the sum so far, later stages first, as
//! candle adds them. That sum is accumulated in place, so a tied vocabulary-sized weight does not
//! need three copies of its gradient at once.
//!
//! What a step holds, frees and recomputes when follows the rules of [`crate::rules`], which the
//! planner replays to predict it; `// Rule N` marks where each is implemented.

use crate::graph::{Node, StageGraph, ValueId};
use crate::memory::{set_activity, tensor_bytes, Activity, Phase, Timeline};
use crate::policy::Policy;
use crate::rules::Wiring;
use crate::stage::StageCtx;
use crate::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, DType, InplaceOp2, Layout, Shape, Tensor, Var};
use std::cell::{Cell, OnceCell};
use std::collections::HashMap;
use std::ops::Range;

struct Segment {
    stages: Range<usize>,
    /// Values consumed here but produced before: stored boundaries and graph inputs.
    inputs: Vec<ValueId>,
    /// Values produced here and consumed by a later segment.
    outputs: Vec<ValueId>,
    /// For each value a stage here reads, the last stage here that reads it.
    last_reader: HashMap<ValueId, usize>,
}

impl Segment {
    fn new(stages: Range<usize>, nodes: &[Node], wiring: &Wiring) -> Segment {
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
        let outputs = wiring.stored_at(stages.end).filter(|&v| wiring.producer(v).is_some_and(|p| p >= stages.start)).collect();
        Segment { stages, inputs, outputs, last_reader }
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
    pub loss: Tensor,
    /// Gradients of the parameters (detached), keyed as candle keys them.
    pub grads: GradStore,
    pub timeline: Timeline,
}

/// What the first step learns about the parameters' gradients; later steps only read it.
struct Schedule {
    /// How many stages give each parameter a gradient: a micro-batch after the first adds a
    /// parameter's gradient to the running sum once all of them are in ([`ParamGrads::add`]).
    contributions: Vec<usize>,
    /// For each parameter, the segment after whose backward its gradient is complete (`None`: it
    /// gets none): [`Executor::accumulate_reporting`] reports it then.
    complete_after: Vec<Option<usize>>,
}

impl Schedule {
    /// The parameters whose gradients are complete once segment `s`'s backward has run.
    fn complete_after(&self, s: usize) -> Vec<usize> {
        (0..self.complete_after.len()).filter(|&k| self.complete_after[k] == Some(s)).collect()
    }
}

/// Runs training steps of a [`StageGraph`] under a [`Policy`].
pub struct Executor<'g> {
    graph: &'g StageGraph,
    segments: Vec<Segment>,
    /// The earliest segment that reads each value: the one that takes it over (Rule 5).
    first_consumer: Vec<Option<usize>>,
    params: Vec<Var>,
    seed: u64,
    replay_rng: bool,
    tell_recompute: bool,
    /// Learned by the first step, which starts from empty gradients.
    schedule: OnceCell<Schedule>,
    /// Backward starts from the loss times this (f16 loss scaling); the returned loss is unscaled.
    loss_scale: Cell<f64>,
}

impl<'g> Executor<'g> {
    /// `params` are the trainable variables whose gradients [`Executor::step`] returns.
    pub fn new(graph: &'g StageGraph, policy: &Policy, params: Vec<Var>, seed: u64) -> Result<Self> {
        let ranges = policy.segments(graph)?;
        let output = graph.output()?;
        let nodes = graph.nodes();
        if nodes.is_empty() {
            return Err(Error::Graph("the graph has no stages".into()));
        }
        let wiring = Wiring::new(graph.n_values(), nodes.iter().map(|n| (&n.inputs[..], &n.outputs[..])));
        let mut seg_of_stage = vec![0; nodes.len()];
        for (s, r) in ranges.iter().enumerate() {
            r.clone().for_each(|i| seg_of_stage[i] = s);
        }
        if wiring.producer(output).map(|p| seg_of_stage[p]) != Some(ranges.len() - 1) {
            return Err(Error::Graph("the loss must be produced by a stage of the last segment".into()));
        }
        // Rule 5: the earliest segment that reads a value.
        let first_consumer = (0..graph.n_values()).map(|v| wiring.first_reader(v).map(|r| seg_of_stage[r])).collect();
        let segments = ranges.into_iter().map(|stages| Segment::new(stages, nodes, &wiring)).collect();
        Ok(Executor {
            graph,
            segments,
            first_consumer,
            params,
            seed,
            replay_rng: true,
            tell_recompute: true,
            schedule: OnceCell::new(),
            loss_scale: Cell::new(1.0),
        })
    }

    /// Switches RNG replay off: recomputes draw fresh random keys, as a checkpoint built on global
    /// RNG state would. Exists only to show that the bit-exactness tests can fail.
    #[doc(hidden)]
    pub fn without_rng_replay(mut self) -> Self {
        self.replay_rng = false;
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

    /// The values kept between forward and backward (the stored boundaries), graph inputs excluded.
    pub fn stored_values(&self) -> Vec<ValueId> {
        let n = self.graph.n_inputs();
        let last = self.segments.len() - 1;
        let mut v: Vec<ValueId> = self.segments[..last].iter().flat_map(|s| s.outputs.iter().copied()).filter(|&v| v >= n).collect();
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
    /// each segment's backward, those no earlier segment contributes to, so that data parallelism
    /// can average them across ranks while the earlier segments recompute; at the end, the rest.
    /// Every parameter is reported once, in the same order on every step after the first (which
    /// learns where gradients complete, and reports them all at the end). `finished` may take the
    /// reported gradients out of the store (no later stage adds to them) and put them back later.
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
        let mut run = StepRun::start(self, inputs, step);
        // Rule 8: the earlier micro-batches' gradients are held throughout.
        let held = grad_bytes(&self.params, &grads);
        let (loss, kept) = run.forward(held)?;
        let mut sums = ParamGrads::new(grads, expected, self.params.len());
        run.backward(kept, &mut sums, &mut Reporter::new(finished, schedule, self.params.len()))?;
        let (grads, learned) = sums.finish();
        if schedule.is_none() {
            let _ = self.schedule.set(learned);
        }
        Ok(StepOutput { loss, grads, timeline: run.timeline })
    }
}

/// One step in flight: the values it stores, the gradients of values waiting for their
/// producer's backward, and its memory timeline.
struct StepRun<'e, 'g> {
    exec: &'e Executor<'g>,
    step: u64,
    stored: Vec<Option<Tensor>>,
    value_grads: HashMap<ValueId, Tensor>,
    timeline: Timeline,
}

impl<'e, 'g> StepRun<'e, 'g> {
    fn start(exec: &'e Executor<'g>, inputs: &[Tensor], step: u64) -> Self {
        let device = inputs.first().map_or(candle_core::Device::Cpu, |t| t.device().clone());
        let timeline = Timeline::start(&device);
        let mut stored: Vec<Option<Tensor>> = vec![None; exec.graph.n_values()];
        for (slot, t) in stored.iter_mut().zip(inputs) {
            *slot = Some(t.clone());
        }
        StepRun { exec, step, stored, value_grads: HashMap::new(), timeline }
    }

    /// Every segment's forward, `grad_bytes` of parameter gradients held meanwhile: the loss and
    /// the last segment's live runs.
    fn forward(&mut self, grad_bytes: u64) -> Result<(Tensor, Vec<Live>)> {
        let segments = &self.exec.segments;
        let last = segments.len() - 1;
        for (s, seg) in segments.iter().enumerate().take(last) {
            let live = self.run_segment(s, false, grad_bytes)?.remove(0);
            // Rule 1, Rule 2: only the stored values outlive the segment's forward, detached.
            for &v in &seg.outputs {
                self.stored[v] = Some(live.values[&v].detach());
            }
        }
        // Rule 3: the last segment's graphs are kept for its backward.
        let kept = self.run_segment(last, false, grad_bytes)?;
        let output = self.exec.graph.output()?;
        let loss = kept.iter().find_map(|l| l.values.get(&output)).expect("the last segment produces the loss").detach();
        Ok((loss, kept))
    }

    /// Every segment's backward, last first, recomputing all but the last (Rule 3), the finished
    /// parameter gradients reported as they complete.
    fn backward(&mut self, kept: Vec<Live>, sums: &mut ParamGrads, reporter: &mut Reporter) -> Result<()> {
        let exec = self.exec;
        let mut kept = Some(kept);
        for s in (0..exec.segments.len()).rev() {
            let runs = match kept.take() {
                Some(runs) => runs,
                None => {
                    // Rule 5: what this segment stores is dead (every later segment is done) and
                    // made anew by its recompute.
                    for &v in &exec.segments[s].outputs {
                        self.stored[v] = None;
                    }
                    self.run_segment(s, true, sums.bytes(&exec.params))?
                }
            };
            SegmentBackward { s, runs }.run(self, sums)?;
            reporter.after_segment(s, &mut sums.sum)?;
        }
        sums.flush(&exec.params)?;
        reporter.rest(&mut sums.sum)
    }

    /// Runs the stages of segment `s`. In the last segment and in a recompute it builds one graph
    /// per stage, every float value a stage consumes (a stored input or an earlier stage's output)
    /// standing in as a `Var` shared by its consumers in the segment, and returns one live run per
    /// stage; otherwise one live run of the whole segment.
    /// `grad_bytes`: parameter gradients held meanwhile, for the timeline.
    fn run_segment(&mut self, s: usize, recompute: bool, grad_bytes: u64) -> Result<Vec<Live>> {
        let exec = self.exec;
        let seg = &exec.segments[s];
        // Rule 3: graphs in the last segment and in a recompute; Rule 2: none otherwise.
        let graphs = recompute || s == exec.segments.len() - 1;
        let mut values = self.segment_inputs(s, graphs)?;
        let mut vars: HashMap<ValueId, Var> = HashMap::new();
        let mut runs = Vec::new();
        let mut whole = Live::default();
        let pass = u64::from(recompute && !exec.replay_rng);
        for i in seg.stages.clone() {
            let node = &exec.graph.nodes()[i];
            let mut live = Live::default();
            let inputs = self.stage_inputs(i, &values, &mut vars, graphs, &mut live)?;
            let ctx = StageCtx::new(exec.seed, self.step, i, pass, recompute && exec.tell_recompute, true);
            set_activity(if recompute { Activity::Recompute } else { Activity::Forward }, Some(i));
            let stage_err = |source| Error::Stage { stage: i, name: node.stage.name(), source };
            let outputs = node.stage.forward(&inputs, &ctx).map_err(stage_err)?;
            drop(inputs);
            if outputs.len() != node.outputs.len() {
                let msg = format!("returned {} outputs, the graph expects {}", outputs.len(), node.outputs.len());
                return Err(stage_err(candle_core::Error::Msg(msg)));
            }
            for (&v, t) in node.outputs.iter().zip(&outputs) {
                values.insert(v, t.clone());
            }
            // A value no later stage here reads is left to whatever else holds it: the runs of its
            // producer and readers (Rule 4: its copy), the op graph of the segment's outputs (Rule
            // 2), nothing once a stored value this segment took over has had its last reader
            // here (Rule 5).
            let last_here = |v: &ValueId| seg.last_reader.get(v).is_none_or(|&j| j <= i);
            values.retain(|v, _| !(last_here(v) && (graphs || !seg.outputs.contains(v))));
            live.values.extend(node.outputs.iter().copied().zip(outputs));
            if graphs {
                runs.push(live);
            } else {
                whole.values.extend(live.values.into_iter().filter(|(v, _)| seg.outputs.contains(v)));
            }
            // Rule 9
            self.timeline.record(if recompute { Phase::Recompute } else { Phase::Forward }, i, grad_bytes);
        }
        if !graphs {
            runs.push(whole);
        }
        Ok(runs)
    }

    /// The stored values and graph inputs segment `s` reads.
    fn segment_inputs(&mut self, s: usize, graphs: bool) -> Result<HashMap<ValueId, Tensor>> {
        let exec = self.exec;
        let mut values = HashMap::new();
        for &v in &exec.segments[s].inputs {
            let t = self.stored[v].clone().ok_or_else(|| Error::Graph(format!("value {v} was not stored")))?;
            if graphs && exec.first_consumer[v] == Some(s) && v >= exec.graph.n_inputs() {
                // Rule 5: taken over by this segment, which holds it until its last reader here
                // (its `Var` copy from the first on); kept stored as well, it would live on.
                self.stored[v] = None;
            }
            values.insert(v, t);
        }
        Ok(values)
    }

    /// The tensors stage `i` runs on. With `graphs`, a float value (not a graph input) is read
    /// through its `Var` copy, made by its first reader in the segment (Rule 4) and recorded in
    /// `live`.
    fn stage_inputs(
        &self,
        i: usize,
        values: &HashMap<ValueId, Tensor>,
        vars: &mut HashMap<ValueId, Var>,
        graphs: bool,
        live: &mut Live,
    ) -> Result<Vec<Tensor>> {
        let node = &self.exec.graph.nodes()[i];
        let mut inputs = Vec::with_capacity(node.inputs.len());
        for &v in &node.inputs {
            let t = &values[&v];
            if graphs && v >= self.exec.graph.n_inputs() && t.dtype().is_float() {
                let var = match vars.get(&v) {
                    Some(var) => var.clone(),
                    None => vars.entry(v).or_insert(Var::from_tensor(&t.detach())?).clone(),
                };
                inputs.push(var.as_tensor().clone());
                live.input_vars.push((v, var));
            } else {
                inputs.push(t.clone());
            }
        }
        Ok(inputs)
    }
}

/// The backward of one segment: the live runs of its stages, walked last first.
struct SegmentBackward {
    s: usize,
    runs: Vec<Live>,
}

impl SegmentBackward {
    fn run(mut self, step: &mut StepRun, sums: &mut ParamGrads) -> Result<()> {
        let exec = step.exec;
        for i in exec.segments[self.s].stages.clone().rev() {
            let live = self.runs.pop().expect("one live run per stage");
            self.stage(i, live, step, sums)?;
            // Rule 9: after Rule 6's drop.
            step.timeline.record(Phase::Backward, i, sums.bytes(&exec.params));
        }
        Ok(())
    }

    /// Stage `i`'s backward: its parameter gradients into `sums`, its input gradients passed on.
    /// Rule 6: its run is dropped on return.
    fn stage(&self, i: usize, live: Live, step: &mut StepRun, sums: &mut ParamGrads) -> Result<()> {
        let Some(root) = self.root(i, &live, step)? else { return Ok(()) };
        set_activity(Activity::Backward, Some(i));
        let mut grads = root.backward()?;
        for (k, p) in step.exec.params.iter().enumerate() {
            if let Some(g) = grads.remove(p.as_tensor()) {
                sums.add(k, p, g.detach(), self.s)?;
            }
        }
        Self::pass_on(&live, &mut grads, step)
    }

    /// What stage `i`'s backward starts from: the loss (scaled) if the stage computes it, plus a
    /// seed for each output whose gradient is waiting (Rule 7: taken up here); `None` when
    /// nothing flows into the stage.
    fn root(&self, i: usize, live: &Live, step: &mut StepRun) -> Result<Option<Tensor>> {
        let exec = step.exec;
        let output = exec.graph.output()?;
        let outputs = &exec.graph.nodes()[i].outputs;
        let mut root = if self.s == exec.segments.len() - 1 && outputs.contains(&output) {
            let loss = &live.values[&output];
            let scale = exec.loss_scale.get();
            Some(if scale == 1.0 { loss.clone() } else { (loss * scale)? })
        } else {
            None
        };
        for &v in outputs {
            if let Some(g) = step.value_grads.remove(&v) {
                let seeded = seed(&live.values[&v], g)?;
                root = Some(match root {
                    Some(r) => (r + seeded)?,
                    None => seeded,
                });
            }
        }
        Ok(root)
    }

    /// Rule 7: the gradients of the stage's inputs (their `Var` copies), each added to what the
    /// value's later readers gave.
    fn pass_on(live: &Live, grads: &mut GradStore, step: &mut StepRun) -> Result<()> {
        for (v, var) in &live.input_vars {
            if let Some(g) = grads.remove(var.as_tensor()) {
                // Detached: a gradient's ops reference this stage's forward tensors, which would
                // otherwise stay alive until an earlier stage consumes it.
                let g = match step.value_grads.remove(v) {
                    Some(acc) => (acc + g)?.detach(),
                    None => g.detach(),
                };
                step.value_grads.insert(*v, g);
            }
        }
        Ok(())
    }
}

/// Hands the parameters whose gradients are complete to the caller of
/// [`Executor::accumulate_reporting`], each once.
struct Reporter<'f, 's> {
    finished: &'f mut dyn FnMut(&[usize], &mut GradStore) -> candle_core::Result<()>,
    /// `None` on the first step, which reports everything at the end.
    schedule: Option<&'s Schedule>,
    reported: Vec<bool>,
}

impl<'f, 's> Reporter<'f, 's> {
    fn new(finished: &'f mut dyn FnMut(&[usize], &mut GradStore) -> candle_core::Result<()>, schedule: Option<&'s Schedule>, n_params: usize) -> Self {
        Reporter { finished, schedule, reported: vec![false; n_params] }
    }

    /// After segment `s`'s backward: the gradients no earlier segment adds to.
    fn after_segment(&mut self, s: usize, store: &mut GradStore) -> Result<()> {
        match self.schedule {
            Some(schedule) => self.report(&schedule.complete_after(s), store),
            None => Ok(()),
        }
    }

    /// At the end of the step: every parameter not reported yet.
    fn rest(&mut self, store: &mut GradStore) -> Result<()> {
        let rest: Vec<usize> = (0..self.reported.len()).filter(|&k| !self.reported[k]).collect();
        self.report(&rest, store)
    }

    fn report(&mut self, ready: &[usize], store: &mut GradStore) -> Result<()> {
        if !ready.is_empty() {
            (self.finished)(ready, store)?;
            ready.iter().for_each(|&k| self.reported[k] = true);
        }
        Ok(())
    }
}

/// The parameter gradients of a step: the running sum (over stages, and over micro-batches when
/// accumulating) and, while accumulating, this micro-batch's partial sums of the parameters that
/// several stages use. Rule 8.
struct ParamGrads<'s> {
    sum: GradStore,
    partial: GradStore,
    /// Contributions seen this micro-batch, per parameter.
    seen: Vec<usize>,
    /// The earliest segment that gave each parameter a gradient so far.
    lowest: Vec<Option<usize>>,
    /// Contributions a micro-batch gives each parameter (`None`: the first micro-batch, which
    /// sums straight into `sum`).
    expected: Option<&'s [usize]>,
}

impl<'s> ParamGrads<'s> {
    fn new(sum: GradStore, expected: Option<&'s [usize]>, n_params: usize) -> Self {
        ParamGrads { sum, partial: GradStore::default(), seen: vec![0; n_params], lowest: vec![None; n_params], expected }
    }

    /// Adds one stage's gradient `g` of parameter `k`, from segment `s`.
    fn add(&mut self, k: usize, p: &Var, g: Tensor, s: usize) -> Result<()> {
        self.seen[k] += 1;
        self.lowest[k] = Some(s);
        let Some(expected) = self.expected else { return add_into(&mut self.sum, p, g) };
        if expected[k] == 1 {
            return add_into(&mut self.sum, p, g);
        }
        add_into(&mut self.partial, p, g)?;
        if self.seen[k] == expected[k] {
            let complete = self.partial.remove(p.as_tensor()).expect("just added");
            add_into(&mut self.sum, p, complete)?;
        }
        Ok(())
    }

    /// Adds the partial sums still aside (contributions that did not all come) to the sum.
    fn flush(&mut self, params: &[Var]) -> Result<()> {
        for p in params {
            if let Some(g) = self.partial.remove(p.as_tensor()) {
                add_into(&mut self.sum, p, g)?;
            }
        }
        Ok(())
    }

    fn bytes(&self, params: &[Var]) -> u64 {
        grad_bytes(params, &self.sum) + grad_bytes(params, &self.partial)
    }

    /// The sum, and where this step's gradients came from.
    fn finish(self) -> (GradStore, Schedule) {
        (self.sum, Schedule { contributions: self.seen, complete_after: self.lowest })
    }
}

/// Bytes of the gradients of `params` that `store` holds.
fn grad_bytes(params: &[Var], store: &GradStore) -> u64 {
    params.iter().filter_map(|p| store.get(p)).map(tensor_bytes).sum()
}

/// `store[p] += g`: in place where it can be (the same bits as candle's `acc + g`).
fn add_into(store: &mut GradStore, p: &Var, g: Tensor) -> Result<()> {
    let sum = match store.get(p.as_tensor()) {
        Some(acc) if adds_in_place(acc, &g) => {
            acc.inplace_op2(&g.contiguous()?, &AddAssign)?;
            return Ok(());
        }
        Some(acc) => (acc + g)?,
        None => g,
    };
    store.insert(p.as_tensor(), sum);
    Ok(())
}

/// Whether `acc += g` can run in place ([`AddAssign`], CPU); elsewhere the sum is a new tensor.
/// The same bits as candle's `acc + g` either way.
fn adds_in_place(acc: &Tensor, g: &Tensor) -> bool {
    acc.device().is_cpu() && acc.is_contiguous() && g.dtype() == acc.dtype() && g.shape() == acc.shape()
}

struct AddAssign;

impl InplaceOp2 for AddAssign {
    fn name(&self) -> &'static str {
        "remat-add-assign"
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<()> {
        fn add<T: Copy + std::ops::Add<Output = T>>(a: &mut [T], b: &[T]) {
            a.iter_mut().zip(b).for_each(|(a, &b)| *a = *a + b);
        }
        let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
            candle_core::bail!("remat-add-assign: operands must be contiguous")
        };
        match (s1, s2) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => add(&mut a[a0..a1], &b[b0..b1]),
            (CpuStorage::F64(a), CpuStorage::F64(b)) => add(&mut a[a0..a1], &b[b0..b1]),
            (CpuStorage::F16(a), CpuStorage::F16(b)) => add(&mut a[a0..a1], &b[b0..b1]),
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => add(&mut a[a0..a1], &b[b0..b1]),
            _ => candle_core::bail!("remat-add-assign: float operands of one dtype only"),
        }
        Ok(())
    }
}

/// A zero scalar whose backward hands `grad` to `t` unchanged: `t`'s gradient becomes `0 + grad`,
/// as in a plain backward.
pub(crate) fn seed(t: &Tensor, grad: Tensor) -> Result<Tensor> {
    if t.device().is_cpu() {
        Ok(t.apply_op1(GradSeed(grad))?)
    } else {
        // No device kernel for the custom op yet: sum(t * g) has the same gradient, 1 * g = g.
        Ok((t * grad)?.sum_all()?.to_dtype(DType::F32)?)
    }
}

struct GradSeed(Tensor);

impl CustomOp1 for GradSeed {
    fn name(&self) -> &'static str {
        "remat-grad-seed"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![0.0]), Shape::from(())))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, _grad_res: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(self.0.clone()))
    }
}
