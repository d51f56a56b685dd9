//! The executor: forward keeping only segment boundaries, backward segment by segment.
//!
//! candle has no hook to start backprop from a given output gradient, and `backward()` needs the
//! whole forward graph alive. So each non-last segment runs forward on detached inputs and only
//! its boundary outputs are kept (detached). Backward walks the segments in reverse: it turns the
//! stored inputs into fresh `Var`s, recomputes the segment, seeds each output with its incoming
//! gradient, calls `backward()`, moves the parameter gradients (detached) into the step's store
//! and passes the input gradients on. The last segment keeps its forward graph: recomputing it
//! would buy nothing. With one segment (`off`) this is exactly plain candle.
//!
//! Bit-exactness with `off` rests on three facts: the recompute draws the same random keys; a
//! seed's backward hands candle the incoming gradient unchanged (`0 + g`, as candle itself does);
//! and a parameter used by several segments (a tied embedding) gets the gradient accumulated so far
//! carried into the earlier segment's backward, where candle adds its own contribution on top in
//! the order a plain backward would (later stages first).

use crate::graph::{StageGraph, ValueId};
use crate::memory::{Phase, Timeline};
use crate::policy::Policy;
use crate::stage::StageCtx;
use crate::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, TensorId, Var};
use std::collections::{HashMap, HashSet};
use std::ops::Range;

struct Segment {
    stages: Range<usize>,
    /// Values consumed here but produced before: stored boundaries and graph inputs.
    inputs: Vec<ValueId>,
    /// Values produced here and consumed by a later segment.
    outputs: Vec<ValueId>,
}

/// The live tensors of one run of a segment: every value it touched, and the `Var`s standing in
/// for its stored inputs.
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
    policy: Policy,
    segments: Vec<Segment>,
    /// The earliest segment that consumes each value: after its backward the value is dead.
    first_consumer: Vec<Option<usize>>,
    params: Vec<Var>,
    param_ids: HashSet<TensorId>,
    seed: u64,
    replay_rng: bool,
    tell_recompute: bool,
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
            ranges.into_iter().map(|stages| Segment { stages, inputs: vec![], outputs: vec![] }).collect();
        for (i, node) in nodes.iter().enumerate() {
            let s = seg_of_stage[i];
            for &v in &node.inputs {
                first_consumer[v] = Some(first_consumer[v].map_or(s, |f: usize| f.min(s)));
                last_consumer[v] = Some(last_consumer[v].map_or(s, |l: usize| l.max(s)));
                if seg_of_value(v) != Some(s) && !segments[s].inputs.contains(&v) {
                    segments[s].inputs.push(v);
                }
            }
        }
        for v in graph.n_inputs()..graph.n_values() {
            let (Some(p), Some(l)) = (seg_of_value(v), last_consumer[v]) else { continue };
            if l > p {
                segments[p].outputs.push(v);
            }
        }
        let param_ids = params.iter().map(|p| p.as_tensor().id()).collect();
        Ok(Executor { graph, policy: policy.clone(), segments, first_consumer, params, param_ids, seed, replay_rng: true, tell_recompute: true })
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

    pub fn policy(&self) -> &Policy {
        &self.policy
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

        // Forward: keep only what crosses a segment boundary; the last segment keeps its graph.
        for s in 0..last {
            let live = self.run_segment(s, &mut stored, step, false, 0, &mut timeline)?;
            for &v in &self.segments[s].outputs {
                stored[v] = Some(live.values[&v].detach());
            }
        }
        let mut kept = Some(self.run_segment(last, &mut stored, step, false, 0, &mut timeline)?);
        let loss = kept.as_ref().map(|l| l.values[&output].detach()).expect("last segment just ran");

        // Backward, last segment first.
        let mut value_grads: HashMap<ValueId, Tensor> = HashMap::new();
        let mut param_grads = GradStore::default();
        for s in (0..=last).rev() {
            let seg = &self.segments[s];
            let live = match kept.take() {
                Some(live) => live,
                None => self.run_segment(s, &mut stored, step, true, grad_bytes(&param_grads, &self.params), &mut timeline)?,
            };
            let mut root = if s == last { Some(live.values[&output].clone()) } else { None };
            for &v in &seg.outputs {
                if let Some(g) = value_grads.remove(&v) {
                    let seeded = seed(&live.values[&v], g)?;
                    root = Some(match root {
                        Some(r) => (r + seeded)?,
                        None => seeded,
                    });
                }
            }
            if let Some(root) = root {
                let root = self.carry_param_grads(root, &mut param_grads)?;
                let mut grads = root.backward()?;
                for p in &self.params {
                    if let Some(g) = grads.remove(p.as_tensor()) {
                        param_grads.insert(p.as_tensor(), g.detach());
                    }
                }
                for (v, var) in &live.input_vars {
                    if let Some(g) = grads.remove(var.as_tensor()) {
                        // Detached: a gradient's ops reference this segment's forward tensors,
                        // which would otherwise stay alive until an earlier segment consumes it.
                        let g = match value_grads.remove(v) {
                            Some(acc) => (acc + g)?.detach(),
                            None => g.detach(),
                        };
                        value_grads.insert(*v, g);
                    }
                }
            }
            drop(live);
            for &v in &seg.inputs {
                if v >= graph.n_inputs() && self.first_consumer[v] == Some(s) {
                    stored[v] = None;
                }
            }
            timeline.record(Phase::Backward, seg.stages.start, grad_bytes(&param_grads, &self.params));
        }
        Ok(StepOutput { loss, grads: param_grads, timeline })
    }

    /// Adds to `root` a seed for every parameter it reaches that already has a gradient from a
    /// later segment, so candle's backward starts that parameter's sum from it. The seeds are the
    /// right-most terms of `root`, so candle visits them before the segment's own nodes.
    fn carry_param_grads(&self, root: Tensor, param_grads: &mut GradStore) -> Result<Tensor> {
        let reached: Vec<Tensor> = root
            .sorted_nodes()
            .into_iter()
            .filter(|n| n.is_variable() && self.param_ids.contains(&n.id()))
            .cloned()
            .collect();
        let mut root = root;
        for p in reached {
            if let Some(acc) = param_grads.remove(&p) {
                root = (root + seed(&p, acc)?)?;
            }
        }
        Ok(root)
    }

    /// Runs the stages of segment `s`. In the last segment and in a recompute, stored inputs
    /// that need a gradient become fresh `Var`s.
    /// `grad_bytes`: parameter gradients held meanwhile, for the timeline.
    fn run_segment(
        &self,
        s: usize,
        stored: &mut [Option<Tensor>],
        step: u64,
        recompute: bool,
        grad_bytes: u64,
        timeline: &mut Timeline,
    ) -> Result<Live> {
        let graph = self.graph;
        let seg = &self.segments[s];
        let needs_vars = recompute || s == self.segments.len() - 1;
        let mut live = Live { values: HashMap::new(), input_vars: Vec::new() };
        for &v in &seg.inputs {
            let t = stored[v].clone().ok_or_else(|| Error::Graph(format!("value {v} was not stored")))?;
            if needs_vars && v >= graph.n_inputs() && t.dtype().is_float() {
                let var = Var::from_tensor(&t)?;
                live.values.insert(v, var.as_tensor().clone());
                live.input_vars.push((v, var));
                if self.first_consumer[v] == Some(s) {
                    // The Var holds a copy; without this the value would live twice.
                    stored[v] = None;
                }
            } else {
                live.values.insert(v, t);
            }
        }
        let pass = u64::from(recompute && !self.replay_rng);
        for i in seg.stages.clone() {
            let node = &graph.nodes()[i];
            let inputs: Vec<Tensor> = node.inputs.iter().map(|v| live.values[v].clone()).collect();
            let ctx = StageCtx::new(self.seed, step, i, pass, recompute && self.tell_recompute, true);
            let stage_err = |source| Error::Stage { stage: i, name: node.stage.name(), source };
            let outputs = node.stage.forward(&inputs, &ctx).map_err(stage_err)?;
            if outputs.len() != node.outputs.len() {
                let msg = format!("returned {} outputs, the graph expects {}", outputs.len(), node.outputs.len());
                return Err(stage_err(candle_core::Error::Msg(msg)));
            }
            live.values.extend(node.outputs.iter().copied().zip(outputs));
            timeline.record(if recompute { Phase::Recompute } else { Phase::Forward }, i, grad_bytes);
        }
        Ok(live)
    }
}

fn grad_bytes(grads: &GradStore, params: &[Var]) -> u64 {
    params.iter().filter_map(|p| grads.get(p)).map(|g| (g.elem_count() * g.dtype().size_in_bytes()) as u64).sum()
}

/// A zero scalar whose backward hands `grad` to `t` unchanged: `t`'s gradient becomes `0 + grad`,
/// as in a plain backward.
fn seed(t: &Tensor, grad: Tensor) -> Result<Tensor> {
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
