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

use crate::graph::{StageGraph, ValueId};
use crate::memory::{set_activity, Activity, Phase, Timeline};
use crate::policy::Policy;
use crate::stage::StageCtx;
use crate::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, DType, InplaceOp2, Layout, Shape, Tensor, Var};
use std::cell::{Cell, RefCell};
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

/// The live tensors of one stage run with a graph (or of a whole segment run without): every
/// value it touched, and the `Var`s standing in for its float inputs.
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

/// Runs training steps of a [`StageGraph`] under a [`Policy`].
pub struct Executor<'g> {
    graph: &'g StageGraph,
    segments: Vec<Segment>,
    /// The earliest segment that consumes each value: after its backward the value is dead.
    first_consumer: Vec<Option<usize>>,
    params: Vec<Var>,
    seed: u64,
    replay_rng: bool,
    tell_recompute: bool,
    /// How many stages give each parameter a gradient, learned by a step that starts from empty
    /// gradients: [`Executor::accumulate`] adds a parameter's micro-batch gradient to the running
    /// sum once it is complete.
    contributions: RefCell<Option<Vec<usize>>>,
    /// For each parameter, the segment after whose backward its gradient is complete (`None`: it
    /// gets none), learned by the first step: [`Executor::accumulate_reporting`] reports it then.
    finished_after: RefCell<Option<Vec<Option<usize>>>>,
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
        let mut seg_of_stage = vec![0; nodes.len()];
        for (s, r) in ranges.iter().enumerate() {
            r.clone().for_each(|i| seg_of_stage[i] = s);
        }
        let seg_of_value = |v: ValueId| graph.producer(v).map(|p| seg_of_stage[p]);
        if seg_of_value(output) != Some(ranges.len() - 1) {
            return Err(Error::Graph("the loss must be produced by a stage of the last segment".into()));
        }
        let mut first_consumer = vec![None; graph.n_values()];
        let mut last_consumer = vec![None; graph.n_values()];
        let mut segments: Vec<Segment> =
            ranges.into_iter().map(|stages| Segment { stages, inputs: vec![], outputs: vec![], last_reader: HashMap::new() }).collect();
        for (i, node) in nodes.iter().enumerate() {
            let s = seg_of_stage[i];
            for &v in &node.inputs {
                first_consumer[v] = Some(first_consumer[v].map_or(s, |f: usize| f.min(s)));
                last_consumer[v] = Some(last_consumer[v].map_or(s, |l: usize| l.max(s)));
                segments[s].last_reader.insert(v, i); // stages come in order: the last insert wins
                if seg_of_value(v) != Some(s) && !segments[s].inputs.contains(&v) {
                    segments[s].inputs.push(v);
                }
            }
        }
        for (v, &last) in last_consumer.iter().enumerate().skip(graph.n_inputs()) {
            let (Some(p), Some(l)) = (seg_of_value(v), last) else { continue };
            if l > p {
                segments[p].outputs.push(v);
            }
        }
        Ok(Executor {
            graph,
            segments,
            first_consumer,
            params,
            seed,
            replay_rng: true,
            tell_recompute: true,
            contributions: RefCell::new(None),
            finished_after: RefCell::new(None),
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
        let graph = self.graph;
        if inputs.len() != graph.n_inputs() {
            return Err(Error::Graph(format!("expected {} inputs, got {}", graph.n_inputs(), inputs.len())));
        }
        let device = inputs.first().map_or(candle_core::Device::Cpu, |t| t.device().clone());
        let mut timeline = Timeline::start(&device);
        let mut stored: Vec<Option<Tensor>> = vec![None; graph.n_values()];
        for (slot, t) in stored.iter_mut().zip(inputs) {
            *slot = Some(t.clone());
        }
        let last = self.segments.len() - 1;
        let output = graph.output()?;

        let first = self.params.iter().all(|p| grads.get(p).is_none());
        let expected = if first {
            None
        } else {
            let learned = self.contributions.borrow().clone();
            Some(learned.ok_or_else(|| Error::Graph("accumulate: the first micro-batch must start from empty gradients".into()))?)
        };
        let mut sums = ParamGrads { sum: grads, partial: GradStore::default(), seen: vec![0; self.params.len()], expected };
        // Earlier micro-batches' gradients are held throughout (the timeline counts them).
        let held = sums.bytes(&self.params);
        // Forward: keep only what crosses a segment boundary; the last segment keeps its graphs.
        for s in 0..last {
            let live = self.run_segment(s, &mut stored, step, false, held, &mut timeline)?.remove(0);
            for &v in &self.segments[s].outputs {
                stored[v] = Some(live.values[&v].detach());
            }
        }
        let mut kept = Some(self.run_segment(last, &mut stored, step, false, held, &mut timeline)?);
        let loss = kept.iter().flatten().find_map(|l| l.values.get(&output)).expect("the last segment produces the loss").detach();

        // Backward, last segment first, each segment's stages last first.
        let mut value_grads: HashMap<ValueId, Tensor> = HashMap::new();
        let finished_after = self.finished_after.borrow().clone();
        let (mut lowest, mut reported) = (vec![None; self.params.len()], vec![false; self.params.len()]);
        for s in (0..=last).rev() {
            let seg = &self.segments[s];
            let mut stages = match kept.take() {
                Some(stages) => stages,
                None => self.run_segment(s, &mut stored, step, true, sums.bytes(&self.params), &mut timeline)?,
            };
            for i in seg.stages.clone().rev() {
                let live = stages.pop().expect("one live run per stage");
                let mut root = if s == last && self.graph.nodes()[i].outputs.contains(&output) {
                    let loss = &live.values[&output];
                    let scale = self.loss_scale.get();
                    Some(if scale == 1.0 { loss.clone() } else { (loss * scale)? })
                } else {
                    None
                };
                for &v in &self.graph.nodes()[i].outputs {
                    if let Some(g) = value_grads.remove(&v) {
                        let seeded = seed(&live.values[&v], g)?;
                        root = Some(match root {
                            Some(r) => (r + seeded)?,
                            None => seeded,
                        });
                    }
                }
                if let Some(root) = root {
                    set_activity(Activity::Backward, Some(i));
                    let mut grads = root.backward()?;
                    for (k, p) in self.params.iter().enumerate() {
                        if let Some(g) = grads.remove(p.as_tensor()) {
                            sums.add(k, p, g.detach())?;
                            lowest[k] = Some(s);
                        }
                    }
                    for (v, var) in &live.input_vars {
                        if let Some(g) = grads.remove(var.as_tensor()) {
                            // Detached: a gradient's ops reference this stage's forward tensors,
                            // which would otherwise stay alive until an earlier stage consumes it.
                            let g = match value_grads.remove(v) {
                                Some(acc) => (acc + g)?.detach(),
                                None => g.detach(),
                            };
                            value_grads.insert(*v, g);
                        }
                    }
                }
                drop(live);
                timeline.record(Phase::Backward, i, sums.bytes(&self.params));
            }
            for &v in &seg.inputs {
                if v >= graph.n_inputs() && self.first_consumer[v] == Some(s) {
                    stored[v] = None;
                }
            }
            if let Some(after) = &finished_after {
                let ready: Vec<usize> = (0..self.params.len()).filter(|&k| after[k] == Some(s)).collect();
                if !ready.is_empty() {
                    finished(&ready, &mut sums.sum)?;
                    ready.iter().for_each(|&k| reported[k] = true);
                }
            }
        }
        for p in &self.params {
            if let Some(g) = sums.partial.remove(p.as_tensor()) {
                add_into(&mut sums.sum, p, g)?;
            }
        }
        let rest: Vec<usize> = (0..self.params.len()).filter(|&k| !reported[k]).collect();
        if !rest.is_empty() {
            finished(&rest, &mut sums.sum)?;
        }
        if finished_after.is_none() {
            *self.finished_after.borrow_mut() = Some(lowest);
        }
        if first {
            *self.contributions.borrow_mut() = Some(sums.seen);
        }
        Ok(StepOutput { loss, grads: sums.sum, timeline })
    }

    /// Runs the stages of segment `s`. In the last segment and in a recompute it builds one graph
    /// per stage, every float value a stage consumes (a stored input or an earlier stage's output)
    /// standing in as a `Var` shared by its consumers in the segment, and returns one live run per
    /// stage; otherwise one live run of the whole segment.
    /// `grad_bytes`: parameter gradients held meanwhile, for the timeline.
    fn run_segment(&self, s: usize, stored: &mut [Option<Tensor>], step: u64, recompute: bool, grad_bytes: u64, timeline: &mut Timeline) -> Result<Vec<Live>> {
        let graph = self.graph;
        let seg = &self.segments[s];
        let graphs = recompute || s == self.segments.len() - 1;
        let mut values: HashMap<ValueId, Tensor> = HashMap::new();
        for &v in &seg.inputs {
            let t = stored[v].clone().ok_or_else(|| Error::Graph(format!("value {v} was not stored")))?;
            if graphs && self.first_consumer[v] == Some(s) && v >= graph.n_inputs() {
                // A `Var` will hold a copy; without this the value would live twice.
                stored[v] = None;
            }
            values.insert(v, t);
        }
        let mut vars: HashMap<ValueId, Var> = HashMap::new();
        let mut runs = Vec::new();
        let mut whole = Live { values: HashMap::new(), input_vars: Vec::new() };
        let pass = u64::from(recompute && !self.replay_rng);
        for i in seg.stages.clone() {
            let node = &graph.nodes()[i];
            let mut live = Live { values: HashMap::new(), input_vars: Vec::new() };
            let mut inputs = Vec::with_capacity(node.inputs.len());
            for &v in &node.inputs {
                let t = &values[&v];
                if graphs && v >= graph.n_inputs() && t.dtype().is_float() {
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
            let ctx = StageCtx::new(self.seed, step, i, pass, recompute && self.tell_recompute, true);
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
            // A value no later stage of this segment reads is held by its stage's run only.
            let last_here = |v: &ValueId| seg.last_reader.get(v).is_none_or(|&j| j <= i);
            values.retain(|v, _| !(last_here(v) && (graphs || !seg.outputs.contains(v))));
            live.values.extend(node.outputs.iter().copied().zip(outputs));
            if graphs {
                runs.push(live);
            } else {
                whole.values.extend(live.values.into_iter().filter(|(v, _)| seg.outputs.contains(v)));
            }
            timeline.record(if recompute { Phase::Recompute } else { Phase::Forward }, i, grad_bytes);
        }
        if !graphs {
            runs.push(whole);
        }
        Ok(runs)
    }
}

/// The parameter gradients of a step: the running sum (over stages, and over micro-batches when
/// accumulating) and, while accumulating, this micro-batch's partial sums of the parameters that
/// several stages use.
struct ParamGrads {
    sum: GradStore,
    partial: GradStore,
    /// Contributions seen this micro-batch, per parameter.
    seen: Vec<usize>,
    /// Contributions a micro-batch gives each parameter (`None`: the first micro-batch, which
    /// sums straight into `sum`).
    expected: Option<Vec<usize>>,
}

impl ParamGrads {
    /// Adds one stage's gradient `g` of parameter `k`.
    fn add(&mut self, k: usize, p: &Var, g: Tensor) -> Result<()> {
        self.seen[k] += 1;
        let Some(expected) = &self.expected else { return add_into(&mut self.sum, p, g) };
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

    fn bytes(&self, params: &[Var]) -> u64 {
        params.iter().flat_map(|p| [self.sum.get(p), self.partial.get(p)]).flatten().map(crate::memory::tensor_bytes).sum()
    }
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
