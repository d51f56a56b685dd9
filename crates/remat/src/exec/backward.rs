//! A step's backward: the segments last first, recomputing all but the last, and each segment's
//! stages walked in reverse, one backward unit's graph at a time (a stage, or K stages under
//! `+units=K`: [`SegmentBackward`]).

use super::forward::StepRun;
use super::grads::{ParamGrads, Reporter};
use super::ops::seed;
use super::state::Saved;
use super::Live;
use crate::memory::{set_activity, Activity, Phase};
use crate::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::Tensor;
use std::ops::Range;

impl<'e, 'g> StepRun<'e, 'g> {
    /// Every segment's backward, last first, recomputing all but the last (Rule 3), the finished
    /// parameter gradients reported as they complete (after the backward of the earliest stage
    /// that uses each). `changed_by`: for each segment, the variables its forward changes, put
    /// back after its recompute.
    pub(super) fn backward(
        &mut self,
        kept: Vec<Live>,
        changed_by: &[Vec<usize>],
        sums: &mut ParamGrads,
        reporter: &mut Reporter,
    ) -> Result<()> {
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
                    let saved = Saved::save(&exec.params, &changed_by[s])?;
                    let runs = self.run_segment(s, true, sums.bytes(&exec.params))?;
                    saved.restore()?;
                    runs
                }
            };
            SegmentBackward { s, runs }.run(self, sums, reporter)?;
        }
        sums.flush(&exec.params)?;
        reporter.rest(&mut sums.sum)
    }
}

/// The backward of one segment: the live runs of its stages, walked last first, one backward unit
/// at a time (a stage, or K stages under `+units=K`: Rule 11).
struct SegmentBackward {
    s: usize,
    runs: Vec<Live>,
}

impl SegmentBackward {
    fn run(
        mut self,
        step: &mut StepRun,
        sums: &mut ParamGrads,
        reporter: &mut Reporter,
    ) -> Result<()> {
        let exec = step.exec;
        for unit in exec.segments[self.s].units.iter().rev() {
            let lives = self.runs.split_off(self.runs.len() - unit.len());
            self.unit(unit, lives, step, sums, reporter)?;
            for i in unit.clone().rev() {
                reporter.after_stage(i, &mut sums.sum)?;
                // Rule 9: after Rule 6's drop, and after the caller took what was reported.
                step.timeline.record(Phase::Backward, i, sums.bytes(&exec.params));
            }
        }
        Ok(())
    }

    /// The backward of the stages in `unit` (`lives`: their runs, in order): their parameter
    /// gradients into `sums`, the gradients of what they read from outside the unit passed on.
    /// Rule 6: the runs are dropped on return.
    fn unit(
        &self,
        unit: &Range<usize>,
        lives: Vec<Live>,
        step: &mut StepRun,
        sums: &mut ParamGrads,
        reporter: &Reporter,
    ) -> Result<()> {
        let Some(root) = self.root(unit, &lives, step)? else { return Ok(()) };
        set_activity(Activity::Backward, Some(unit.end - 1));
        let mut grads = root.backward()?;
        for (k, p) in step.exec.params.iter().enumerate() {
            if let Some(g) = grads.remove(p.as_tensor()) {
                if reporter.reported(k) {
                    // Its update may have run already: stop rather than train on part of it.
                    let msg = format!(
                        "stages {unit:?} gave parameter {k} a gradient after it was reported \
                         complete: their forward did not show the use"
                    );
                    return Err(Error::Graph(msg));
                }
                sums.add(k, p, g.detach())?;
            }
        }
        lives.iter().try_for_each(|live| Self::pass_on(live, &mut grads, step))
    }

    /// What the backward of `unit` starts from: the loss (scaled) if a stage of it computes it,
    /// plus a seed for each output whose gradient is waiting (Rule 7: taken up here); `None`
    /// when nothing flows into the unit.
    fn root(
        &self,
        unit: &Range<usize>,
        lives: &[Live],
        step: &mut StepRun,
    ) -> Result<Option<Tensor>> {
        let exec = step.exec;
        let output = exec.graph.output()?;
        let mut root: Option<Tensor> = None;
        let mut add = |t: Tensor| -> Result<()> {
            root = Some(match root.take() {
                Some(r) => (r + t)?,
                None => t,
            });
            Ok(())
        };
        for (i, live) in unit.clone().zip(lives).rev() {
            let outputs = &exec.graph.nodes()[i].outputs;
            if self.s == exec.segments.len() - 1 && outputs.contains(&output) {
                let loss = &live.values[&output];
                let scale = exec.loss_scale.get();
                add(if scale == 1.0 { loss.clone() } else { (loss * scale)? })?;
            }
            for &v in outputs {
                if let Some(g) = step.value_grads.remove(&v) {
                    add(seed(&live.values[&v], g)?)?;
                }
            }
        }
        Ok(root)
    }

    /// Rule 7: the gradients of a stage's inputs read through `Var`s, each added to what the
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
