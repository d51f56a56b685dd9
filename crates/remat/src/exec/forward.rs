//! One step in flight ([`StepRun`]): its forward, segment by segment, and the segment runs that
//! the forward and the recomputes share.

use super::state::StateFinder;
use super::{Executor, Live};
use crate::graph::ValueId;
use crate::keep::{Mode, Scope, Stash};
use crate::memory::{set_activity, Activity, Phase, Timeline};
use crate::stage::StageCtx;
use crate::{Error, Result};
use candle_core::{Tensor, Var};
use std::collections::HashMap;
use std::ops::Range;

/// One step in flight: the values it stores, the gradients of values waiting for their
/// producer's backward, and its memory timeline.
pub(super) struct StepRun<'e, 'g> {
    pub(super) exec: &'e Executor<'g>,
    step: u64,
    pub(super) stored: Vec<Option<Tensor>>,
    /// The ops' outputs kept for the recomputes (Rule 10).
    stash: Stash,
    pub(super) value_grads: HashMap<ValueId, Tensor>,
    pub(super) timeline: Timeline,
    /// On the first step, for each parameter the earliest stage whose outputs depend on it, as
    /// the forward finds them: its gradient is complete after that stage's backward.
    pub(super) first_users: Option<Vec<Option<usize>>>,
    /// The forward's digests of the outputs of the stages to be recomputed, by stage.
    digests: HashMap<usize, Vec<Option<u64>>>,
}

impl<'e, 'g> StepRun<'e, 'g> {
    /// `find_users`: record [`StepRun::first_users`] (the first step).
    pub(super) fn start(
        exec: &'e Executor<'g>,
        inputs: &[Tensor],
        step: u64,
        find_users: bool,
    ) -> Self {
        let device = inputs.first().map_or(candle_core::Device::Cpu, |t| t.device().clone());
        let timeline = Timeline::start(&device);
        let mut stored: Vec<Option<Tensor>> = vec![None; exec.graph.n_values()];
        for (slot, t) in stored.iter_mut().zip(inputs) {
            *slot = Some(t.clone());
        }
        let first_users = find_users.then(|| vec![None; exec.params.len()]);
        StepRun {
            exec,
            step,
            stored,
            stash: Stash::default(),
            value_grads: HashMap::new(),
            timeline,
            first_users,
            digests: HashMap::new(),
        }
    }

    /// Stage `i`'s forward made `outputs`: every parameter their op graph reaches that no earlier
    /// stage's did is first used here. An earlier segment's stage outputs reach back through the
    /// segment's earlier stages too, whose parameters are claimed already.
    fn find_users(&mut self, i: usize, outputs: &[Tensor]) {
        let Some(first_users) = &mut self.first_users else { return };
        let unclaimed: HashMap<_, usize> = self
            .exec
            .params
            .iter()
            .enumerate()
            .filter(|(k, _)| first_users[*k].is_none())
            .map(|(k, p)| (p.as_tensor().id(), k))
            .collect();
        for t in outputs {
            for node in t.sorted_nodes() {
                if let Some(&k) = unclaimed.get(&node.id()) {
                    first_users[k] = Some(i);
                }
            }
        }
    }

    /// Every segment's forward, `grad_bytes` of parameter gradients held meanwhile: the loss and
    /// the last segment's live runs. With `finder` (the first step), the variables each segment
    /// changes are found.
    pub(super) fn forward(
        &mut self,
        grad_bytes: u64,
        mut finder: Option<&mut StateFinder>,
    ) -> Result<(Tensor, Vec<Live>)> {
        let segments = &self.exec.segments;
        let last = segments.len() - 1;
        for (s, seg) in segments.iter().enumerate().take(last) {
            let live = self.run_segment(s, false, grad_bytes)?.remove(0);
            // Rule 1, Rule 2: only the stored values outlive the segment's forward, detached.
            for &v in &seg.outputs {
                self.stored[v] = Some(super::ops::stored_value(&live.values[&v])?);
            }
            if let Some(finder) = finder.as_deref_mut() {
                finder.after_segment(&self.exec.params)?;
            }
        }
        // A `+keep=` that kept nothing would silently recompute everything: the graph runs none
        // of those ops through `keep::op` (a candle-nn `Linear` is not one).
        if !self.exec.keep.is_empty() && last > 0 && !self.stash.keeps_any() {
            return Err(Error::KeepsNothing {
                keep: self.exec.keep.to_string(),
                seen: self.stash.seen().to_string(),
            });
        }
        // Rule 3: the last segment's graphs are kept for its backward.
        let kept = self.run_segment(last, false, grad_bytes)?;
        if let Some(finder) = finder {
            finder.after_segment(&self.exec.params)?;
        }
        let output = self.exec.graph.output()?;
        let loss = kept
            .iter()
            .find_map(|l| l.values.get(&output))
            .expect("the last segment produces the loss")
            .detach();
        Ok((loss, kept))
    }
    /// Runs the stages of segment `s`. In the last segment and in a recompute it builds one graph
    /// per stage, every float value a stage consumes (a stored input or an earlier stage's output)
    /// standing in as a `Var` shared by its consumers in the segment, and returns one live run per
    /// stage; otherwise one live run of the whole segment.
    /// `grad_bytes`: parameter gradients held meanwhile, for the timeline.
    pub(super) fn run_segment(
        &mut self,
        s: usize,
        recompute: bool,
        grad_bytes: u64,
    ) -> Result<Vec<Live>> {
        let exec = self.exec;
        let seg = &exec.segments[s];
        // Rule 3: graphs in the last segment and in a recompute; Rule 2: none otherwise.
        let graphs = recompute || s == exec.segments.len() - 1;
        let mut values = self.segment_inputs(s, graphs)?;
        let mut vars: HashMap<ValueId, Var> = HashMap::new();
        let mut runs = Vec::new();
        let mut whole = Live::default();
        let pass = u64::from(recompute && !exec.replay_rng);
        // Rule 10: a segment to be recomputed keeps the policy's ops' outputs, its recompute
        // replays them.
        let keep = match (graphs, recompute) {
            _ if exec.keep.is_empty() => None,
            (false, _) => Some(Mode::Keep),
            (true, true) => Some(Mode::Replay),
            (true, false) => None,
        };
        for i in seg.stages.clone() {
            let node = &exec.graph.nodes()[i];
            let mut live = Live::default();
            let inputs =
                self.stage_inputs(i, seg.unit_of(i), &values, &mut vars, graphs, &mut live)?;
            let ctx = StageCtx::new(crate::RunPoint {
                seed: exec.seed,
                step: self.step,
                stage: i,
                pass,
                recompute: recompute && exec.tell_recompute,
                train: true,
            });
            set_activity(if recompute { Activity::Recompute } else { Activity::Forward }, Some(i));
            let stage_err = |source| Error::Stage { stage: i, name: node.stage.name(), source };
            let scope = keep.map(|mode| Scope::enter(mode, exec.keep, i, &self.stash));
            let outputs = node.stage.forward(&inputs, &ctx).map_err(stage_err)?;
            drop((scope, inputs));
            self.after_stage(i, &outputs, graphs, recompute)?;
            for (&v, t) in node.outputs.iter().zip(&outputs) {
                values.insert(v, t.clone());
            }
            // A value no later stage here reads is left to whatever else holds it: the runs of its
            // producer and readers (Rule 4: its `Var`), the op graph of the segment's outputs (Rule
            // 2), nothing once a stored value this segment took over has had its last reader
            // here (Rule 5).
            let last_here = |v: &ValueId| seg.last_reader.get(v).is_none_or(|&j| j <= i);
            values.retain(|v, _| !(last_here(v) && (graphs || !seg.outputs.contains(v))));
            live.values.extend(node.outputs.iter().copied().zip(outputs));
            if graphs {
                runs.push(live);
            } else {
                whole
                    .values
                    .extend(live.values.into_iter().filter(|(v, _)| seg.outputs.contains(v)));
            }
            // Rule 9
            self.timeline.record(
                if recompute { Phase::Recompute } else { Phase::Forward },
                i,
                grad_bytes,
            );
        }
        if !graphs {
            runs.push(whole);
        }
        Ok(runs)
    }

    /// After stage `i` ran (`graphs`: with a graph of its own): its outputs counted against the
    /// graph's; in forward, their users found; for the recompute check, their digests taken in the
    /// forward of a segment to be recomputed and compared in its recompute.
    fn after_stage(
        &mut self,
        i: usize,
        outputs: &[Tensor],
        graphs: bool,
        recompute: bool,
    ) -> Result<()> {
        let node = &self.exec.graph.nodes()[i];
        if outputs.len() != node.outputs.len() {
            let msg = format!(
                "returned {} outputs, the graph expects {}",
                outputs.len(),
                node.outputs.len()
            );
            let source = candle_core::Error::Msg(msg);
            return Err(Error::Stage { stage: i, name: node.stage.name(), source });
        }
        if !recompute {
            self.find_users(i, outputs);
        }
        if self.exec.check_recompute && !graphs {
            self.digests.insert(i, outputs.iter().map(super::ops::digest).collect::<Result<_>>()?);
        } else if self.exec.check_recompute && recompute {
            self.check_recompute(i, outputs)?;
        }
        Ok(())
    }

    /// Fails naming stage `i` if a recomputed output's digest differs from its forward's.
    fn check_recompute(&mut self, i: usize, outputs: &[Tensor]) -> Result<()> {
        let forward = self.digests.remove(&i).unwrap_or_default();
        for (k, (t, before)) in outputs.iter().zip(forward).enumerate() {
            if before.is_some() && super::ops::digest(t)? != before {
                return Err(Error::Recompute {
                    stage: i,
                    name: self.exec.graph.nodes()[i].stage.name(),
                    output: k,
                });
            }
        }
        Ok(())
    }

    /// The stored values and graph inputs segment `s` reads.
    fn segment_inputs(&mut self, s: usize, graphs: bool) -> Result<HashMap<ValueId, Tensor>> {
        let exec = self.exec;
        let mut values = HashMap::new();
        for &v in &exec.segments[s].inputs {
            let t = self.stored[v]
                .clone()
                .ok_or_else(|| Error::Graph(format!("value {v} was not stored")))?;
            if graphs && exec.first_consumer[v] == Some(s) && v >= exec.graph.n_inputs() {
                // Rule 5: taken over by this segment, which holds it through its first reader's
                // `Var` (Rule 4); kept stored as well, it would live on.
                self.stored[v] = None;
            }
            values.insert(v, t);
        }
        Ok(values)
    }

    /// The tensors stage `i` runs on. With `graphs`, a float value (not a graph input) that no
    /// stage of `i`'s backward unit produces is read through its `Var`, made over its memory by
    /// its first such reader in the segment (Rules 4 and 11) and recorded in `live`.
    fn stage_inputs(
        &self,
        i: usize,
        unit: &Range<usize>,
        values: &HashMap<ValueId, Tensor>,
        vars: &mut HashMap<ValueId, Var>,
        graphs: bool,
        live: &mut Live,
    ) -> Result<Vec<Tensor>> {
        let exec = self.exec;
        let node = &exec.graph.nodes()[i];
        let own = |v: ValueId| exec.producer[v].is_some_and(|p| unit.contains(&p));
        let mut inputs = Vec::with_capacity(node.inputs.len());
        for &v in &node.inputs {
            let t = &values[&v];
            if graphs && v >= exec.graph.n_inputs() && t.dtype().is_float() && !own(v) {
                let var = match vars.get(&v) {
                    Some(var) => var.clone(),
                    None => vars.entry(v).or_insert(super::var_over(t)?).clone(),
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
