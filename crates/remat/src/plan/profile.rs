//! Measuring a profile: every stage run alone under the memory meter, in each of the executor's
//! modes ([`Profile::measure`]), and profiles at other batch sizes ([`Profile::extrapolate`]).

use super::{PlanError, Profile, SharedGrad, StageCost, ValueCost};
use crate::graph::{StageGraph, ValueId};
use crate::keep::{KeptOp, Mode, OpSet, Scope, Stash};
use crate::memory::{set_activity, tensor_bytes, Activity, Counter};
use crate::signature::Signature;
use crate::stage::{StageCtx, StageKind};
use crate::{Error, Result};
use candle_core::{DType, Tensor, TensorId, Var};
use std::collections::HashMap;
use std::time::Instant;

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
    /// This profile with `extra` copies of the stage `block` after it: the profile of the same
    /// model `extra` blocks deeper, from a shallow model's measurement (a model whose weights do
    /// not fit in memory is profiled at a few blocks, its blocks being alike). `block` is one of a
    /// run of alike blocks, each reading the single output of the one before: each copy reads the
    /// one before it, every later stage reads the last copy's output where it read `block`'s, and
    /// the stages after `block` (and the shared gradients that name them) move `extra` places on.
    pub fn deepened(&self, block: usize, extra: usize) -> Result<Profile> {
        let refused = || Error::Profile(PlanError::Deepen(block));
        let template = self.stages.get(block).ok_or_else(refused)?;
        let ([_], &[out]) = (template.inputs.as_slice(), template.outputs.as_slice()) else {
            return Err(refused());
        };
        // Values keep their order of production; `renamed[old]` is an old value's new id.
        let mut values = self.values[..self.n_inputs].to_vec();
        let mut renamed: Vec<Option<ValueId>> =
            (0..self.values.len()).map(|v| (v < self.n_inputs).then_some(v)).collect();
        let produce = |values: &mut Vec<ValueCost>, cost: ValueCost| {
            values.push(cost);
            values.len() - 1
        };
        let mut stages = Vec::with_capacity(self.stages.len() + extra);
        for (i, stage) in self.stages.iter().enumerate() {
            let mut s = stage.clone();
            s.inputs = stage
                .inputs
                .iter()
                .map(|&v| renamed[v])
                .collect::<Option<_>>()
                .ok_or_else(refused)?;
            s.outputs = stage
                .outputs
                .iter()
                .map(|&v| {
                    let id = produce(&mut values, self.values[v]);
                    renamed[v] = Some(id);
                    id
                })
                .collect();
            stages.push(s);
            if i == block {
                for k in 1..=extra {
                    let mut copy = template.clone();
                    copy.name = format!("{} (+{k})", template.name);
                    copy.inputs = vec![renamed[out].expect("produced above")];
                    let id = produce(&mut values, self.values[out]);
                    copy.outputs = vec![id];
                    renamed[out] = Some(id);
                    stages.push(copy);
                }
            }
        }
        let moved = |i: usize| if i > block { i + extra } else { i };
        let shared_grads = self
            .shared_grads
            .iter()
            .map(|g| SharedGrad { first: moved(g.first), last: moved(g.last), bytes: g.bytes })
            .collect();
        Ok(Profile { batch: self.batch, n_inputs: self.n_inputs, values, stages, shared_grads })
    }

    /// Measures every stage of `graph` on `inputs` (a batch of `batch`); `params` are the
    /// trainable variables. Stages run in training mode with the recompute flag set, so nothing
    /// is updated (BatchNorm statistics) and dropout draws as in a step.
    ///
    /// A stage with the [signature](crate::Stage::signature) of one measured before, on inputs of
    /// the same shapes and dtypes, is not run: it takes that stage's figures, and its outputs
    /// are that stage's (of the same shapes and dtypes, by the signature's promise), which later
    /// stages read in their place. GPT-2 XL's 48 blocks then cost one block's measurement.
    /// [`Profile::measure_each`] measures every stage.
    pub fn measure(
        graph: &StageGraph,
        inputs: &[Tensor],
        params: &[Var],
        batch: usize,
        seed: u64,
    ) -> Result<Profile> {
        measure_graph(graph, inputs, params, batch, seed, true)
    }

    /// [`Profile::measure`] without reusing any stage's figures: what the reuse is checked against.
    pub fn measure_each(
        graph: &StageGraph,
        inputs: &[Tensor],
        params: &[Var],
        batch: usize,
        seed: u64,
    ) -> Result<Profile> {
        measure_graph(graph, inputs, params, batch, seed, false)
    }

    /// The profile at `batch` (`inputs_at(n)`: the graph inputs of a batch of `n`), measured at
    /// that batch. Stages run one at a time, so this needs one stage's memory, not a step's.
    pub fn at_batch<E: std::fmt::Display>(
        graph: &StageGraph,
        inputs_at: impl Fn(usize) -> std::result::Result<Vec<Tensor>, E>,
        params: &[Var],
        batch: usize,
        seed: u64,
    ) -> Result<Profile> {
        let inputs = inputs_at(batch).map_err(|e| Error::Data(format!("{e:#}")))?;
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
        let (one, two) = (
            Profile::at_batch(graph, &inputs_at, params, probes.0, seed)?,
            Profile::at_batch(graph, &inputs_at, params, probes.1, seed)?,
        );
        Ok(Profile::extrapolate(&one, &two, batch)?)
    }

    /// The profile at `batch`, from profiles `a` and `b` of the same graph at two batch sizes:
    /// every quantity on the line through the two (bytes rounded, never below zero).
    pub fn extrapolate(
        a: &Profile,
        b: &Profile,
        batch: usize,
    ) -> std::result::Result<Profile, PlanError> {
        let same = a.batch != b.batch
            && a.stages.len() == b.stages.len()
            && a.values.len() == b.values.len();
        if !same {
            return Err(PlanError::Extrapolate(a.batch, b.batch));
        }
        let t = (batch as f64 - a.batch as f64) / (b.batch as f64 - a.batch as f64);
        let line = |x: f64, y: f64| x + (y - x) * t;
        let bytes = |x: u64, y: u64| line(x as f64, y as f64).round().max(0.0) as u64;
        let ms = |x: f64, y: f64| line(x, y).max(0.0);
        let values = a
            .values
            .iter()
            .zip(&b.values)
            .map(|(x, y)| ValueCost { bytes: bytes(x.bytes, y.bytes), float: x.float })
            .collect();
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
                backward_retained: bytes(x.backward_retained, y.backward_retained),
                inputs_retained: x
                    .inputs_retained
                    .iter()
                    .zip(&y.inputs_retained)
                    .map(|(&x, &y)| bytes(x, y))
                    .collect(),
                param_grad_bytes: x.param_grad_bytes,
                forward_ms: ms(x.forward_ms, y.forward_ms),
                backward_ms: ms(x.backward_ms, y.backward_ms),
                keepable: x
                    .keepable
                    .iter()
                    .zip(&y.keepable)
                    .map(|(a, b)| KeptOp {
                        bytes: bytes(a.bytes, b.bytes),
                        ms: ms(a.ms, b.ms),
                        ..*a
                    })
                    .collect(),
                ..x.clone()
            })
            .collect();
        Ok(Profile {
            batch,
            n_inputs: a.n_inputs,
            values,
            stages,
            shared_grads: a.shared_grads.clone(),
        })
    }

    /// Every stage's kind, in order.
    pub fn kinds(&self) -> Vec<StageKind> {
        self.stages.iter().map(|s| s.kind).collect()
    }

    /// Bytes of every parameter gradient.
    pub fn param_grad_bytes(&self) -> u64 {
        self.stages.iter().map(|s| s.param_grad_bytes).sum()
    }
}

/// A stage measured in full, for stages alike to reuse: its costs, its outputs and its parameter
/// gradients' bytes (all its own, by the signature's promise).
struct Measured {
    cost: StageCost,
    outputs: Vec<Tensor>,
    param_grad_bytes: u64,
}

/// What makes stages alike: a signature and the shapes and dtypes of the inputs.
type AlikeKey = (Signature, Vec<(Vec<usize>, DType)>);

/// What measuring a graph's stages needs throughout: the meter, where the graph's own values
/// start and which is its loss, the parameters whose gradients are counted, the seed.
struct Meter<'a> {
    counter: Counter,
    n_inputs: usize,
    output: ValueId,
    params: &'a [Var],
    seed: u64,
}

/// Which stages use each parameter, found as stages are measured: its first and last user and
/// its gradient's bytes, by index in the parameter list.
struct Users {
    first: Vec<Option<usize>>,
    last: Vec<Option<usize>>,
    bytes: Vec<u64>,
}

impl Users {
    fn new(n: usize) -> Self {
        Users { first: vec![None; n], last: vec![None; n], bytes: vec![0; n] }
    }

    /// Stage `i`'s backward gave these parameter gradients.
    fn record(&mut self, i: usize, grads: &ParamGradBytes) {
        for &(k, bytes) in grads {
            self.first[k].get_or_insert(i);
            self.last[k] = Some(i);
            self.bytes[k] = bytes;
        }
    }

    /// Each parameter's gradient counted at its last user in forward order: the first stage
    /// whose backward makes it.
    fn add_grads_to(&self, stages: &mut [StageCost]) {
        for (k, user) in self.last.iter().enumerate() {
            if let Some(i) = user {
                stages[*i].param_grad_bytes += self.bytes[k];
            }
        }
    }

    /// The parameters used by more than one stage (Rule 8: their partial sums).
    fn shared(&self) -> Vec<SharedGrad> {
        (0..self.bytes.len())
            .filter_map(|k| match (self.first[k], self.last[k]) {
                (Some(first), Some(last)) if first < last => {
                    Some(SharedGrad { first, last, bytes: self.bytes[k] })
                }
                _ => None,
            })
            .collect()
    }
}

/// The stages measured so far: each one measured in full that others may be alike to, with what
/// it measured; the parameters' users; the gradient bytes of the stages that took an alike one's
/// figures.
struct Measuring<'a> {
    meter: Meter<'a>,
    /// Whether alike stages reuse the figures of the first one measured.
    reuse: bool,
    alike: HashMap<AlikeKey, Measured>,
    users: Users,
    reused_grad_bytes: Vec<u64>,
}

impl Measuring<'_> {
    /// Stage `i` (`node`) on its inputs `ins`: its outputs and its costs, measured, or an alike
    /// stage's where one was measured and `reuse`.
    fn stage(
        &mut self,
        i: usize,
        node: &crate::graph::Node,
        ins: &[Tensor],
    ) -> Result<(Vec<Tensor>, StageCost)> {
        let shapes = || ins.iter().map(|t| (t.dims().to_vec(), t.dtype())).collect::<Vec<_>>();
        let key = node.stage.signature().filter(|_| self.reuse).map(|s| (s, shapes()));
        if let Some(m) = key.as_ref().and_then(|k| self.alike.get(k)) {
            self.reused_grad_bytes[i] = m.param_grad_bytes;
            let cost = StageCost {
                name: node.stage.name(),
                kind: node.stage.kind(),
                inputs: node.inputs.clone(),
                outputs: node.outputs.clone(),
                ..m.cost.clone()
            };
            return Ok((m.outputs.clone(), cost));
        }
        let (outs, cost, grads) = measure_twice(&self.meter, node, i, ins)?;
        if let Some(key) = key {
            let param_grad_bytes = grads.iter().map(|(_, b)| b).sum();
            let measured = Measured { cost: cost.clone(), outputs: outs.clone(), param_grad_bytes };
            self.alike.insert(key, measured);
        }
        self.users.record(i, &grads);
        Ok((outs, cost))
    }
}

/// [`Profile::measure`], reusing alike stages' figures where `reuse`.
fn measure_graph(
    graph: &StageGraph,
    inputs: &[Tensor],
    params: &[Var],
    batch: usize,
    seed: u64,
    reuse: bool,
) -> Result<Profile> {
    if inputs.len() != graph.n_inputs() {
        return Err(Error::Inputs { expected: graph.n_inputs(), got: inputs.len() });
    }
    let device = inputs.first().map_or(&candle_core::Device::Cpu, |t| t.device());
    // Without the counting allocator every byte measured on the CPU is 0, and a plan made on
    // zeros would fit any budget.
    if device.is_cpu() && !crate::memory::heap_meter_installed() {
        return Err(Error::NoMeter);
    }
    let n_inputs = graph.n_inputs();
    let meter = Meter {
        counter: Counter::for_device(device),
        n_inputs,
        output: graph.output()?,
        params,
        seed,
    };
    let mut measuring = Measuring {
        meter,
        reuse,
        alike: HashMap::new(),
        users: Users::new(params.len()),
        reused_grad_bytes: vec![0; graph.nodes().len()],
    };
    let mut values: Vec<Option<Tensor>> = vec![None; graph.n_values()];
    let mut costs: Vec<ValueCost> = vec![ValueCost { bytes: 0, float: false }; graph.n_values()];
    for (v, t) in inputs.iter().enumerate() {
        costs[v] = ValueCost { bytes: tensor_bytes(t), float: t.dtype().is_float() };
        values[v] = Some(t.clone());
    }
    let mut stages = Vec::with_capacity(graph.nodes().len());
    let last_reader = graph.last_readers();
    for (i, node) in graph.nodes().iter().enumerate() {
        let produced = |&v: &ValueId| {
            values[v].clone().ok_or_else(|| Error::Graph(format!("value {v} was not produced")))
        };
        let ins = node.inputs.iter().map(produced).collect::<Result<Vec<_>>>()?;
        let (outs, cost) = measuring.stage(i, node, &ins)?;
        for (&v, t) in node.outputs.iter().zip(&outs) {
            costs[v] = ValueCost { bytes: tensor_bytes(t), float: t.dtype().is_float() };
            values[v] = Some(t.clone());
        }
        for &v in &node.inputs {
            if last_reader[v] == Some(i) && v >= n_inputs {
                values[v] = None;
            }
        }
        stages.push(cost);
    }
    measuring.users.add_grads_to(&mut stages);
    for (stage, bytes) in stages.iter_mut().zip(measuring.reused_grad_bytes) {
        stage.param_grad_bytes += bytes;
    }
    set_activity(Activity::Setup, None);
    let shared_grads = measuring.users.shared();
    Ok(Profile { batch, n_inputs, values: costs, stages, shared_grads })
}

/// Stage `i` measured twice, every figure the smaller of the two: a kernel's first call may grow
/// a workspace it keeps (per thread, by the size it meets), and the process's first parallel call
/// starts its thread pool, neither the stage's to keep. So no pass needs to run before a
/// measurement: a pass thrown away first left every prediction of remat's schedule test
/// unchanged to the byte. Twice is not enough for a workspace each pool thread makes on its first
/// product (gemm's packing buffer): both runs may put the product on a thread new to it, so the
/// callers make those first (`ops::allocate_matmul_workspaces`).
fn measure_twice(
    meter: &Meter,
    node: &crate::graph::Node,
    i: usize,
    ins: &[Tensor],
) -> Result<(Vec<Tensor>, StageCost, ParamGradBytes)> {
    let (outs, first, grads) = measure_stage(meter, node, i, ins)?;
    let (_, second, _) = measure_stage(meter, node, i, ins)?;
    Ok((outs, first.least(&second), grads))
}

/// Bytes of each parameter gradient a stage's backward gives, by index in the parameter list.
type ParamGradBytes = Vec<(usize, u64)>;

/// One measurement of stage `i` of a graph on its inputs `ins`: its outputs (detached), its
/// costs, and the bytes of each parameter gradient (by index in `params`) its backward gives.
fn measure_stage(
    meter: &Meter,
    node: &crate::graph::Node,
    i: usize,
    ins: &[Tensor],
) -> Result<(Vec<Tensor>, StageCost, ParamGradBytes)> {
    let (counter, n_inputs, output, params, seed) =
        (&meter.counter, meter.n_inputs, meter.output, meter.params, meter.seed);
    let stage_err = |source| Error::Stage { stage: i, name: node.stage.name(), source };
    let ctx = || {
        StageCtx::new(crate::RunPoint {
            seed,
            stage: i,
            recompute: true,
            train: true,
            ..Default::default()
        })
    };
    set_activity(Activity::Forward, Some(i));
    // Without a graph of its own: the outputs keep their op graph until detached.
    let (outs, chain_bytes, chain_transient, _) =
        metered(counter, || node.stage.forward(ins, &ctx()).map_err(stage_err))?;
    let detached: Vec<Tensor> = outs.iter().map(Tensor::detach).collect();
    drop(outs);
    // With a graph on `Var`s over its inputs, as the executor's last segment and recomputes run it.
    let run_ins = on_vars(node, ins, n_inputs)?;
    // The ops a policy could keep (`+keep=`) are measured in passing: their outputs' bytes and
    // times.
    let stash = Stash::default();
    let (outs, graph_bytes, graph_transient, forward_ms) = metered(counter, || {
        let _scope = Scope::enter(Mode::Measure, OpSet::all(), i, &stash);
        node.stage.forward(&run_ins, &ctx()).map_err(stage_err)
    })?;
    let keepable = stash.take_measured();
    // Backward from the loss, or from a gradient of ones (made before it is metered) for every
    // other float output.
    let seeds = node
        .outputs
        .iter()
        .zip(&outs)
        .filter(|(&v, t)| v != output && t.dtype().is_float())
        .map(|(_, t)| Ok((t.clone(), t.ones_like()?)))
        .collect::<Result<Vec<_>>>()?;
    let loss = node.outputs.iter().position(|&v| v == output).map(|k| outs[k].clone());
    set_activity(Activity::Backward, Some(i));
    let (mut grads, grads_left, above_left, backward_ms) =
        metered(counter, || backward_from(loss.clone(), seeds))?;
    // What the gradients' op graphs hold, freed as they are detached: the inputs' gradients'
    // apart (a backward unit reads an input its own stages produce without a `Var`, Rule 11),
    // then the rest.
    let detach = |grads: &mut Option<candle_core::backprop::GradStore>, ids: &[TensorId]| {
        let before = counter.current();
        if let Some(grads) = grads.as_mut() {
            for &id in ids {
                if let Some(g) = grads.get_id(id).map(Tensor::detach) {
                    grads.insert_id(id, g);
                }
            }
        }
        before.saturating_sub(counter.current())
    };
    let inputs_retained = run_ins.iter().map(|t| detach(&mut grads, &[t.id()])).collect();
    let all: Vec<TensorId> = grads.as_ref().map_or(Vec::new(), |g| g.get_ids().copied().collect());
    let backward_retained = detach(&mut grads, &all);
    let param_grads = params
        .iter()
        .enumerate()
        .filter_map(|(k, p)| Some((k, counter.held_bytes(grads.as_ref()?.get(p)?))))
        .collect();
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
        backward_retained,
        inputs_retained,
        param_grad_bytes: 0,
        forward_ms,
        backward_ms,
        keepable,
    };
    Ok((detached, cost, param_grads))
}

/// A stage's inputs `ins` as its graph runs on them: each float value of the graph's own (not
/// one of its `n_inputs` inputs) through a `Var` over it.
fn on_vars(node: &crate::graph::Node, ins: &[Tensor], n_inputs: usize) -> Result<Vec<Tensor>> {
    node.inputs
        .iter()
        .zip(ins)
        .map(|(&v, t)| {
            Ok(if v >= n_inputs && t.dtype().is_float() {
                crate::exec::var_over(t)?.as_tensor().clone()
            } else {
                t.clone()
            })
        })
        .collect()
}

/// A backward from `loss` (if any) and from each of `seeds`' tensors with its gradient; `None`
/// where there is nothing to start from.
fn backward_from(
    loss: Option<Tensor>,
    seeds: Vec<(Tensor, Tensor)>,
) -> Result<Option<candle_core::backprop::GradStore>> {
    let mut root = loss;
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
            backward_retained: self.backward_retained.min(other.backward_retained),
            inputs_retained: (self.inputs_retained.iter().zip(&other.inputs_retained))
                .map(|(a, b)| *a.min(b))
                .collect(),
            forward_ms: self.forward_ms.min(other.forward_ms),
            backward_ms: self.backward_ms.min(other.backward_ms),
            keepable: self
                .keepable
                .iter()
                .zip(&other.keepable)
                .map(|(a, b)| KeptOp { bytes: a.bytes.min(b.bytes), ms: a.ms.min(b.ms), ..*a })
                .collect(),
            ..self.clone()
        }
    }
}
