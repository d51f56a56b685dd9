//! The training loop every trainer binary runs: the optimizer, the policy planned (or a dry run),
//! then step after step ([`Stepper`]) with evaluation and snapshots when due, resumable from a
//! training snapshot. The training path ([`crate::recipe::train`]) builds the model and data and
//! hands them to [`Trainer::run`].

use crate::args::RunArgs;
use crate::inputs::Input;
use crate::log::{Log, LogFile};
use crate::parallel::{self, Group};
use crate::plan::executor;
use crate::say;
use crate::scaler::LossScaler;
use crate::snapshot::{
    check_outputs, load_training, remove_stale_partials, save_training, training_snapshot_path,
    Output, RunConfig,
};
use crate::step::{micro_batches, Stepper};
use anyhow::{bail, Result};
use candle_core::Tensor;
use optim::TrainOptimizer;
use remat::Policy;
use trainable::Model;

/// The graph inputs of data batch `n` of `size` samples.
pub type Inputs<'a> = dyn Fn(u64, usize) -> Result<Vec<Tensor>> + 'a;

/// One training run of `model`, as its command line asked.
pub struct Trainer<'a, M> {
    pub run: &'a RunArgs,
    pub group: &'a Group,
    pub model: &'a M,
    /// The flags that set a step's size, as errors name them: `--batch 2 x --seq 256`.
    pub sizes: String,
    /// What decides what the run computes: the flags, the model and the inputs' content. Its
    /// training snapshots keep it and a resume must match it.
    pub config: RunConfig,
    /// What the trainer writes besides the shared flags' outputs (`--save-merged`,
    /// `--save-adapter`): checked with them before training.
    pub outputs: Vec<Output<'a>>,
    /// The files the run reads (`--init`, `--resume`, `--config`, data, tokenizer, ...): no
    /// output may be one of them.
    pub inputs: Vec<Input>,
    /// How many distinct samples the data holds, where it holds a fixed number
    /// ([`crate::Recipe::samples`]).
    pub samples: Option<usize>,
    /// The inputs the planner measures a batch of `n` with (masked-LM batches of text are padded
    /// to their own longest row: planned at full length).
    pub planned_inputs: &'a dyn Fn(usize) -> Result<Vec<Tensor>>,
    /// What a data batch is, by number, where the data comes from files: named in the error of a
    /// step whose gradients are not finite.
    pub batch_names: Option<Box<dyn Fn(u64) -> String + 'a>>,
}

impl<M: Model> Trainer<'_, M> {
    /// Trains `steps` optimizer steps on `inputs` (a rank takes its share of each batch) and
    /// prints `describe(policy, segments)` once the policy is settled; returns after a dry run's
    /// prediction without training.
    pub fn run(
        mut self,
        inputs: &Inputs,
        describe: impl FnOnce(&Policy, &str) -> String,
    ) -> Result<()> {
        let (run, group, model) = (self.run, self.group, self.model);
        let batch_names = self.batch_names.take();
        check_policy_and_freeze::<M>(run, model.params())?;
        let mut opt = parallel::optimizer(
            parallel::OptimizerState::from_flag(run.shard_optimizer),
            group,
            run.optimizer,
            model.params().vars(),
            run.lr,
        )?;
        let planned = self.planned_inputs;
        let Some((exec, policy)) = executor(run, group, model, opt.as_ref(), &self.sizes, planned)?
        else {
            return Ok(());
        };
        say!("{}", describe(&policy, &crate::segments(exec.segments().len())));
        self.before_training()?;
        crate::interrupt::catch()?;
        let mut scaler = (run.dtype == trainable::Precision::F16).then(|| LossScaler {
            scale: run.loss_scale.unwrap_or(LossScaler::default().scale),
            good_steps: 0,
        });
        let start = self.resume(opt.as_mut(), scaler.as_mut(), &self.config)?;
        let file = match run.resume {
            Some(_) => LogFile::Continue { from: start },
            None => LogFile::New,
        };
        let mut log = Log::new(group, run.steps, run.accumulate, run.log_json.as_deref(), file)?;
        log.start_at(start);

        let stepper = Stepper {
            group,
            exec: &exec,
            accumulate: run.accumulate,
            in_backward: run.optimizer_in_backward,
            batch_names,
        };
        let batch = |n: u64| Ok(group.shard(inputs(n, run.batch * group.world())?)?);
        for step in start..run.steps {
            let scale = scaler.map_or(1.0, |s| s.scale);
            let out = stepper.step(step as u64, scaler.as_mut(), batch, opt.as_mut())?;
            if !out.updated {
                let now = scaler.map_or(1.0, |s| s.scale);
                log.say(format_args!(
                    "step {step}: gradients not finite at loss scale {scale}; update skipped, loss \
                     scale now {now}"
                ));
            }
            let loss = group.mean_of(out.loss)? as f32;
            log.step(step, loss, &out.usage)?;
            if !loss.is_finite() {
                bail!(
                    "step {step}: the loss is {loss}; training cannot go on (a lower --lr may help)"
                );
            }
            if run.eval_every.is_some() && self.due(step, run.eval_every) {
                let eval_loss = self.evaluate(&batch)?;
                log.eval(step, eval_loss, run.eval_batches)?;
            }
            let saved = run.save.is_some() && self.due(step, run.save_every);
            if saved {
                self.save(step, opt.as_ref(), scaler, &self.config)?;
            }
            if step + 1 < run.steps && crate::interrupt::requested(group)? {
                if run.save.is_some() && !saved {
                    self.save(step, opt.as_ref(), scaler, &self.config)?;
                }
                log.finish();
                match run.save.as_deref().map(training_snapshot_path) {
                    Some(path) => say!(
                        "stopped after step {step}; --resume {} goes on from step {}",
                        path.display(),
                        step + 1
                    ),
                    None => say!("stopped after step {step}; nothing saved (no --save given)"),
                }
                return Err(crate::interrupt::Interrupted.into());
            }
        }
        parallel::check_in_sync(group, model.params())?;
        log.finish();
        if let Some(path) = &run.save {
            say!("saved snapshot to {}", path.display());
        }
        Ok(())
    }

    /// What follows from the flags once the policy is settled: the memory cap set, the
    /// accumulation announced, the output files checked. `run` was checked by `launch`
    /// ([`RunArgs::check`]) before anything started.
    fn before_training(&self) -> Result<()> {
        let run = self.run;
        if let Some(cap) = run.memory_cap {
            remat::memory::set_heap_cap(cap);
        }
        if run.accumulate > 1 {
            say!(
                "accumulating {} micro-batches of {} per optimizer step: effective batch {}",
                run.accumulate,
                run.batch,
                run.accumulate * run.batch
            );
        }
        if let (Some(_), Some(samples)) = (run.eval_every, self.samples) {
            let per_step = run.batch * self.group.world();
            let drawn = run.eval_batches.saturating_mul(per_step);
            if drawn > samples {
                bail!(
                    "--eval-batches {} of {per_step} samples draw {drawn} samples per evaluation, \
                     but the data holds {samples} distinct ones: its batches would repeat each \
                     other; give at most {} --eval-batches",
                    run.eval_batches,
                    (samples / per_step).max(1)
                );
            }
            say!(
                "evaluation: {} batches drawn from the data's {samples} samples as training draws \
                 them (a fixed data set has no held-out part: the loss measures the fit to it)",
                run.eval_batches
            );
        }
        if self.group.is_root() {
            check_outputs(run, &self.outputs, &self.inputs)?;
            remove_stale_partials(run, &self.outputs, &self.inputs)?;
        }
        Ok(())
    }

    /// The step to start from: 0, or with `--resume` the training snapshot's next step, its
    /// weights, optimizer state and loss scaler loaded once its configuration matches `config`.
    fn resume(
        &self,
        opt: &mut dyn TrainOptimizer,
        scaler: Option<&mut LossScaler>,
        config: &RunConfig,
    ) -> Result<usize> {
        let (run, params) = (self.run, self.model.params());
        let Some(path) = &run.resume else { return Ok(0) };
        let next = load_training(path, params, opt, run.seed, scaler, config)?;
        if next > run.steps {
            bail!("{} is at step {next}, beyond --steps {}", path.display(), run.steps);
        }
        say!("resumed from {} at step {next}", path.display());
        Ok(next)
    }

    /// Whether something done every `every` steps (if given) and after the last is due after
    /// `step`.
    fn due(&self, step: usize, every: Option<usize>) -> bool {
        let done = step + 1;
        done == self.run.steps || every.is_some_and(|n| n > 0 && done.is_multiple_of(n))
    }

    /// The mean evaluation-mode loss ([`trainable::Model::evaluate`]) over `--eval-batches`
    /// batches: those the data stream gives after the last training micro-batch (of a fixed data
    /// set, drawn from the same samples).
    fn evaluate(&self, inputs: &dyn Fn(u64) -> Result<Vec<Tensor>>) -> Result<f32> {
        let held_out = micro_batches(self.run.steps as u64, self.run.accumulate).start;
        let mut total = 0.0;
        for n in 0..self.run.eval_batches as u64 {
            total += self.model.evaluate(&inputs(held_out + n)?)? as f64;
        }
        Ok(self.group.mean_of(total / self.run.eval_batches as f64)? as f32)
    }

    /// After `step` (0-based): the weights snapshot (the model's own format) and the training
    /// snapshot beside it, written by rank 0.
    fn save(
        &self,
        step: usize,
        opt: &dyn TrainOptimizer,
        scaler: Option<LossScaler>,
        config: &RunConfig,
    ) -> Result<()> {
        // On every rank: a sharded optimizer gathers its state from all of them.
        let Some(state) = opt.snapshot_state()? else { return Ok(()) };
        let Some(path) = self.run.save.as_deref().filter(|_| self.group.is_root()) else {
            return Ok(());
        };
        self.model.save_snapshot(path)?;
        save_training(
            &training_snapshot_path(path),
            self.model.params(),
            state,
            step + 1,
            self.run.seed,
            scaler,
            config,
        )
    }
}

/// Before anything runs: a `+keep=` of an op the model does not run (it would keep nothing),
/// and `--freeze` ([`check_freeze`]).
fn check_policy_and_freeze<M: Model>(run: &RunArgs, params: &params::ParamStore) -> Result<()> {
    if let Some(policy) = run.policy.fixed() {
        M::check_keep(policy).map_err(|e| anyhow::anyhow!("--policy {e}"))?;
    }
    check_freeze(params)
}

/// `--freeze`: every pattern must name a parameter (a typo would freeze nothing), and some
/// parameter must still train.
fn check_freeze(params: &params::ParamStore) -> Result<()> {
    let unmatched = params.unmatched_freeze_patterns();
    if !unmatched.is_empty() {
        let names: Vec<&str> =
            params.named().chain(params.frozen()).map(|(name, _)| name).take(6).collect();
        bail!(
            "--freeze {}: matches no parameter of this model, whose parameters are named like {}, \
             ...",
            unmatched.join(","),
            names.join(", ")
        );
    }
    if params.vars().is_empty() {
        bail!("--freeze leaves no parameter to train");
    }
    Ok(())
}
