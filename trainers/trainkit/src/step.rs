//! One optimizer step as the trainers and the harness's measurement both run it: the
//! micro-batches of gradient accumulation forward and backward under the executor (their
//! gradients summed, and averaged over the ranks of a data-parallel group), the gradients made
//! ready (loss scale, mean over micro-batches), the update; and what it cost.

use crate::parallel::{self, Group};
use crate::scaler::{all_finite, finish_gradients, LossScaler};
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use optim::TrainOptimizer;
use remat::memory::{set_activity, Activity, Meter, Timeline, Usage};
use remat::Executor;

/// The data batches of optimizer step `step` under gradient accumulation: micro-batch `m` is
/// batch `step * accumulate + m`, which also keys its random draws (the trainers and the harness
/// alike; with `accumulate` 1, batch `step`).
pub fn micro_batches(step: u64, accumulate: usize) -> std::ops::Range<u64> {
    let n = accumulate as u64;
    step * n..(step + 1) * n
}

/// What one optimizer step did and what it cost.
pub struct StepOutcome {
    /// The mean of this rank's micro-batch losses.
    pub loss: f64,
    /// Whether the update ran: the loss scaler (f16) skips a step whose gradients are not finite.
    pub updated: bool,
    /// Time and heap of the whole step: forward, backward and the update.
    pub usage: Usage,
    /// The highest heap during forward and backward, above the step's base.
    pub fwd_bwd_peak: u64,
    /// The same less the parameter gradients held at each point, the highest over the
    /// micro-batches: what checkpointing acts on.
    pub activation_peak: u64,
    /// The first micro-batch's memory timeline.
    pub timeline: Timeline,
}

/// Runs optimizer steps of `accumulate` micro-batches under `exec` on the ranks of `group`.
pub struct Stepper<'a> {
    pub group: &'a Group,
    pub exec: &'a Executor<'a>,
    pub accumulate: usize,
    /// The optimizer inside backward (`--optimizer-in-backward`): each parameter updated as soon
    /// as its gradient is final, and the gradient freed. One micro-batch, one rank, no loss
    /// scaler ([`crate::RunArgs::check`] refuses the others).
    pub in_backward: bool,
    /// What a data batch is, by number, where the data comes from files: named in the error of a
    /// step whose gradients are not finite.
    pub batch_names: Option<Box<dyn Fn(u64) -> String + 'a>>,
}

impl Stepper<'_> {
    /// Optimizer step `step`: `inputs(n)` gives the graph inputs of data batch `n` (this rank's
    /// share), for the batches of [`micro_batches`]; `opt` applies the finished gradients.
    /// Without a loss scaler (whose rule is to skip such a step), gradients that are not finite
    /// end the run before they reach the weights, naming the batches whose loss was not finite
    /// (or every batch of the step): a NaN in the data otherwise trains on silently.
    pub fn step(
        &self,
        step: u64,
        scaler: Option<&mut LossScaler>,
        inputs: impl Fn(u64) -> Result<Vec<Tensor>>,
        opt: &mut dyn TrainOptimizer,
    ) -> Result<StepOutcome> {
        if self.in_backward {
            return self.step_in_backward(step, scaler, inputs, opt);
        }
        let batches = micro_batches(step, self.accumulate);
        let last = batches.end - 1;
        self.exec.set_loss_scale(scaler.as_ref().map_or(1.0, |s| s.scale));
        let mut first_inputs = Some(inputs(batches.start)?);
        let meter = Meter::start(first_inputs.as_ref().expect("just made")[0].device());
        let (mut grads, mut total, mut activation_peak, mut timeline) =
            (GradStore::default(), 0f64, 0, None);
        let (mut non_finite_losses, mut bad_data) = (Vec::new(), Vec::new());
        for n in batches.clone() {
            let inputs = match first_inputs.take() {
                Some(inputs) => inputs,
                None => inputs(n)?,
            };
            let out = parallel::accumulate(self.group, self.exec, &inputs, n, last, grads)?;
            let loss = out.loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
            if !loss.is_finite() {
                non_finite_losses.push(n);
                if !inputs_finite(&inputs)? {
                    bad_data.push(n);
                }
            }
            total += loss as f64;
            activation_peak = activation_peak.max(out.timeline.activation_peak(meter.heap_base()));
            timeline.get_or_insert(out.timeline);
            grads = out.grads;
        }
        // Whatever the loss scaler would make of it (f16 skips such steps, forever): the data.
        if !bad_data.is_empty() {
            bail!(
                "step {step}: the data holds a NaN or an infinity ({}), so the weights were not \
                 updated",
                self.name_batches(bad_data)
            );
        }
        if scaler.is_none() && !all_finite(&grads, self.exec.params())? {
            let suspects =
                if non_finite_losses.is_empty() { batches.collect() } else { non_finite_losses };
            bail!(
                "step {step}: the gradients are not finite, so the weights were not updated; a NaN \
                 or an infinity in the data ({}), or a diverging run (a lower --lr may help)",
                self.name_batches(suspects)
            );
        }
        let updated = finish_gradients(&mut grads, self.exec.params(), self.accumulate, scaler)?;
        let fwd_bwd_peak = meter.peak_so_far();
        set_activity(Activity::Optimizer, None);
        if updated {
            opt.update(&grads)?;
        }
        drop(grads);
        let usage = meter.finish();
        let timeline = timeline.expect("at least one micro-batch");
        Ok(StepOutcome {
            loss: total / self.accumulate as f64,
            updated,
            usage,
            fwd_bwd_peak,
            activation_peak,
            timeline,
        })
    }

    /// The data batches `batches`, by the files they come from where the data has them.
    fn name_batches(&self, batches: Vec<u64>) -> String {
        let name = |n: u64| match &self.batch_names {
            Some(names) => format!("data batch {n}: {}", names(n)),
            None => format!("data batch {n}"),
        };
        batches.into_iter().map(name).collect::<Vec<_>>().join("; ")
    }

    /// [`Stepper::step`] with the optimizer inside backward: the executor reports the gradients
    /// each stage's backward finished ([`Executor::accumulate_reporting`]); they are taken out of
    /// the step's store, checked, applied and dropped there.
    fn step_in_backward(
        &self,
        step: u64,
        scaler: Option<&mut LossScaler>,
        inputs: impl Fn(u64) -> Result<Vec<Tensor>>,
        opt: &mut dyn TrainOptimizer,
    ) -> Result<StepOutcome> {
        if self.accumulate != 1 || self.group.world() != 1 || scaler.is_some() {
            bail!(
                "the optimizer inside backward runs one micro-batch on one rank without a loss \
                 scaler"
            );
        }
        let inputs = inputs(step)?;
        let meter = Meter::start(inputs[0].device());
        let params = self.exec.params();
        // What the parameters share (the step count of the bias corrections) advances once, as
        // in an ordinary update; an error later in the step ends the run.
        opt.begin_update()?;
        let out = self.exec.accumulate_reporting(
            &inputs,
            step,
            GradStore::default(),
            &mut |ready, store| {
                let mut part = GradStore::default();
                for &k in ready {
                    if let Some(g) = store.remove(params[k].as_tensor()) {
                        part.insert(params[k].as_tensor(), g);
                    }
                }
                if !all_finite(&part, params)
                    .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?
                {
                    candle_core::bail!(
                    "step {step}: gradients are not finite; the parameters whose gradients were \
                     final before them are updated already (--optimizer-in-backward): a NaN or an \
                     infinity in data batch {step}, or a diverging run (a lower --lr may help)"
                );
                }
                set_activity(Activity::Optimizer, None);
                opt.update_some(&part)
            },
        )?;
        let loss = out.loss.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64;
        let (fwd_bwd_peak, activation_peak) =
            (meter.peak_so_far(), out.timeline.activation_peak(meter.heap_base()));
        drop(out.grads);
        Ok(StepOutcome {
            loss,
            updated: true,
            usage: meter.finish(),
            fwd_bwd_peak,
            activation_peak,
            timeline: out.timeline,
        })
    }
}

/// Whether every value of the float tensors among a batch's `inputs` is finite (ids and labels
/// are) ([`params::all_finite`]).
fn inputs_finite(inputs: &[Tensor]) -> Result<bool> {
    for t in inputs.iter().filter(|t| t.dtype().is_float()) {
        if !params::all_finite(t)? {
            return Ok(false);
        }
    }
    Ok(true)
}
