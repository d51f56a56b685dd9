//! `trainkit`: what every trainer binary shares, so their training loops stay short: a measured
//! training step, a progress bar, one log line per step (loss, time, peak memory), optional JSON
//! records, and the median step time at the end; pre-trained weights and the Hugging Face hub
//! ([`hub`]); data parallelism over the ranks of a `collective::Group` ([`parallel`]). It does not
//! own the loop: each trainer's `main` does. [`reference`] holds what the model tests compare
//! against PyTorch.

pub mod hub;
pub mod parallel;
pub mod reference;

pub use parallel::{launch, optimizer, or_abort, Group};

use anyhow::{bail, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use indicatif::{ProgressBar, ProgressStyle};
use remat::memory::{Meter, Usage};
use remat::Executor;
use serde::Serialize;
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

/// Set on every rank but the first of a data-parallel run: rank 0 speaks for all.
static QUIET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Writes one line to stderr (or stdout), ending the process quietly when the reader has closed
/// the pipe (`train-gpt2 ... 2>&1 | head -2`), where `eprintln!` would panic: with exit 141, as a
/// process killed by SIGPIPE, since the run did not do its work (exit 0 told a script it had).
pub fn say_line(stdout: bool, args: std::fmt::Arguments) {
    if QUIET.load(std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    let result = if stdout {
        let mut out = std::io::stdout().lock();
        out.write_fmt(args).and_then(|_| out.write_all(b"\n")).and_then(|_| out.flush())
    } else {
        let mut err = std::io::stderr().lock();
        err.write_fmt(args).and_then(|_| err.write_all(b"\n"))
    };
    if let Err(e) = result {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(CLOSED_PIPE_EXIT);
        }
    }
}

/// The exit status of a run whose output pipe was closed: 128 + SIGPIPE, a shell's status for a
/// process that signal ended.
pub const CLOSED_PIPE_EXIT: i32 = 141;

/// `eprintln!` that ends quietly on a closed pipe ([`say_line`]).
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => { $crate::say_line(false, format_args!($($arg)*)) };
}

/// `println!` that ends quietly on a closed pipe ([`say_line`]).
#[macro_export]
macro_rules! show {
    ($($arg:tt)*) => { $crate::say_line(true, format_args!($($arg)*)) };
}

/// A learning rate must be a positive finite number: NaN or infinity would train to garbage
/// without a word.
pub fn check_lr(lr: f64) -> Result<()> {
    if !(lr.is_finite() && lr > 0.0) {
        bail!("--lr {lr} is not a positive finite number");
    }
    Ok(())
}

/// Refuses sizes whose `what` alone (a tensor every step must hold, computed by the caller with
/// checked arithmetic: `None` for an overflow) needs more than this machine's available memory
/// (MemAvailable + SwapFree): the error names `flags` and the bytes, where the run would abort
/// inside an allocation. A lower bound of the step's need, so a run that passes can still run out.
pub fn check_footprint(flags: &str, what: &str, elements: Option<u128>) -> Result<()> {
    let Some(bytes) = elements.and_then(|n| n.checked_mul(4)) else {
        bail!("{flags}: {what} would have more elements than this machine can address");
    };
    if let Some(have) = available_memory().map(u128::from) {
        if bytes > have {
            bail!(
                "{flags}: {what} alone needs {:.1} GiB (f32); this machine has {:.1} GiB available",
                bytes as f64 / 2f64.powi(30),
                have as f64 / 2f64.powi(30)
            );
        }
    }
    Ok(())
}

/// This machine's available memory in bytes (MemAvailable + SwapFree), where /proc/meminfo says.
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = |field: &str| meminfo.lines().find_map(|l| l.strip_prefix(field)?.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
    Some((kib("MemAvailable:")? + kib("SwapFree:")?) * 1024)
}

/// The memory a training step starts from, as a budget or a memory cap counts it: everything the
/// device holds now (weights, buffers, data, the optimizer state allocated so far), the optimizer
/// state still to come (SGD's buffers appear at the first update), and one batch of inputs.
pub fn memory_before_step(device: &Device, optimizer: &dyn layers::TrainOptimizer, inputs_bytes: u64) -> Result<u64> {
    let counter = remat::memory::Counter::for_device(device);
    counter.synchronize();
    let allocated: u64 = optimizer.state()?.values().map(remat::memory::tensor_bytes).sum();
    Ok(counter.current() + optimizer.state_bytes().saturating_sub(allocated) + inputs_bytes)
}

/// What the device can still give: free memory on a GPU, available memory on the CPU.
pub fn free_memory(device: &Device) -> Option<u64> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => d.cuda_stream().context().mem_get_info().ok().map(|(free, _)| free as u64),
        _ => available_memory(),
    }
}

/// The memory `auto` plans for: the `--memory-cap` where given, else what the device can still
/// give less a tenth (the allocator's slack, other processes).
pub fn auto_budget(device: &Device, cap: Option<u64>) -> Option<u64> {
    cap.or_else(|| free_memory(device).map(|free| free - free / 10))
}

/// Runs `f` with the heap capped at what this machine can give now (the live heap plus its
/// available memory, or a lower cap already set), with `hint` as the line that follows a
/// refusal: a model or a profile too large for the machine then ends the run with exit 1 and
/// those two lines ([`remat::memory::set_heap_cap`]), instead of swapping the machine to a halt
/// until the kernel's OOM killer ends it (or something else). The cap before is restored after.
pub fn within_memory<T>(hint: String, f: impl FnOnce() -> Result<T>) -> Result<T> {
    use remat::memory::{heap_cap, heap_current, set_heap_cap, set_refusal_hint};
    let before = heap_cap();
    if let Some(free) = available_memory() {
        set_heap_cap(before.min(heap_current().saturating_add(free)));
    }
    set_refusal_hint(hint);
    let out = f();
    set_refusal_hint(String::new());
    set_heap_cap(before);
    out
}

/// Builds a model with [`within_memory`]: `flags` name what sets its size (`--preset/--config`).
pub fn build_model<M>(flags: &str, build: impl FnOnce() -> Result<M>) -> Result<M> {
    let hint = format!("the model does not fit in this machine's available memory: choose a smaller one ({flags})");
    remat::memory::set_activity(remat::memory::Activity::Build, None);
    let model = within_memory(hint, build);
    remat::memory::set_activity(remat::memory::Activity::Setup, None);
    model
}

/// Refuses a training step the device cannot hold, before allocating it: the planner's
/// prediction of the step under `policy` (a budget or `auto`: the least any plan needs), from
/// profiles at batches 1 and 2 extrapolated to `batch` ([`remat::plan::Profile::extrapolate`],
/// which over-predicts a little where temporaries are not linear in the batch), plus the state
/// still to come (optimizer state, the inputs), against what the device can give. `sizes` names
/// the flags that set the step's size. The profiles themselves run [`within_memory`].
fn check_step_fits(
    run: &RunArgs,
    policy: &remat::Policy,
    model: &impl layers::Model,
    optimizer: &dyn layers::TrainOptimizer,
    batch: usize,
    sizes: &str,
    inputs_at: &dyn Fn(usize) -> Result<Vec<Tensor>>,
) -> Result<()> {
    use remat::plan::Profile;
    let (vars, device) = vars_and_device(model);
    let Some(free) = free_memory(&device) else { return Ok(()) };
    let hint = format!("a training step does not fit in this machine's available memory: make it smaller ({sizes})");
    // Each batch measured once (a plan measures twice, for the least of two): this runs at the
    // start of every run, and a first call's workspaces only make it over-predict.
    let measure = |n: usize| -> Result<Profile> { Ok(Profile::measure(model.graph(), &inputs_at(n)?, &vars, n, run.seed)?) };
    let profile = within_memory(hint, || {
        Ok(match batch {
            1 | 2 => measure(batch)?,
            _ => Profile::extrapolate(&measure(1)?, &measure(2)?, batch)?,
        })
    })?;
    let (fixed, held) = step_start(run, &device, optimizer, &profile, batch, inputs_at)?;
    let least = profile.least_peak(held);
    let peak = if policy.needs_plan() { least.estimate.peak } else { profile.predict_policy(policy, held)?.peak };
    // What is already allocated (the model) is not asked of the free memory again.
    let more = fixed.saturating_sub(remat::memory::Counter::for_device(&device).current()).saturating_add(peak);
    if more > free {
        let gib = |b: u64| b as f64 / 2f64.powi(30);
        let other = if least.estimate.peak < peak {
            format!(" (the least any checkpoint plan needs is {:.1} GiB: {})", gib(least.estimate.peak), least.policy())
        } else {
            String::new()
        };
        bail!(
            "{sizes}: a training step under {policy} needs {:.1} GiB beyond the model by the planner's prediction{other}; this device has {:.1} GiB available. Make the step smaller",
            gib(more),
            gib(free)
        );
    }
    Ok(())
}

/// A model's parameters and the device they are on.
fn vars_and_device(model: &impl layers::Model) -> (Vec<candle_core::Var>, Device) {
    let vars = model.params().vars();
    let device = vars.first().map_or(Device::Cpu, |v| v.device().clone());
    (vars, device)
}

/// What a step of `batch` starts from, as the planner counts it: the memory before the step
/// ([`memory_before_step`] with a batch of inputs; called after profiling, so the workspaces
/// kernels keep from their first calls are part of it), and the parameter gradients held across
/// micro-batches (`profile`'s, under `--accumulate`).
fn step_start(
    run: &RunArgs,
    device: &Device,
    optimizer: &dyn layers::TrainOptimizer,
    profile: &remat::plan::Profile,
    batch: usize,
    inputs_at: &dyn Fn(usize) -> Result<Vec<Tensor>>,
) -> Result<(u64, u64)> {
    let inputs: u64 = inputs_at(1)?.iter().map(remat::memory::tensor_bytes).sum::<u64>().saturating_mul(batch as u64);
    let held = if run.accumulate > 1 { profile.param_grad_bytes() } else { 0 };
    Ok((memory_before_step(device, optimizer, inputs)?, held))
}

/// `--policy budget=SIZE`/`auto` and `--dry-run`: profiles the model's stages one at a time at
/// the run's batch ([`remat::plan::Profile::at_batch`]: one stage's memory, not a step's).
/// Returns the executor to train with and its policy (a budget resolved to its plan), or `None`
/// after a dry run, which prints the prediction per phase for the policy and the fixed policies
/// and trains nothing. `inputs_at(n)`: the graph inputs of a batch of `n`. First, a step the
/// device cannot hold is refused ([`check_step_fits`]; `sizes` names the flags that set its size).
#[allow(clippy::too_many_arguments)]
pub fn executor<'m>(
    run: &RunArgs,
    group: &Group,
    policy: &remat::Policy,
    model: &'m impl layers::Model,
    optimizer: &dyn layers::TrainOptimizer,
    batch: usize,
    sizes: &str,
    inputs_at: &dyn Fn(usize) -> Result<Vec<Tensor>>,
) -> Result<Option<(Executor<'m>, remat::Policy)>> {
    check_step_fits(run, policy, model, optimizer, batch, sizes, inputs_at)?;
    let Some(resolved) = plan_policy(run, policy, model, optimizer, batch, inputs_at)? else { return Ok(None) };
    let policy = parallel::agreed_policy(group, policy, resolved)?;
    Ok(Some((Executor::new(model.graph(), &policy, model.params().vars(), rank_seed(run.seed, group.rank()))?, policy)))
}

/// The random keys of rank `rank`: rank 0 draws those of a one-rank run, the others their own
/// (ranks must not share dropout masks); checkpointing replays each rank's keys on recompute.
pub fn rank_seed(seed: u64, rank: usize) -> u64 {
    seed ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn plan_policy(
    run: &RunArgs,
    policy: &remat::Policy,
    model: &impl layers::Model,
    optimizer: &dyn layers::TrainOptimizer,
    batch: usize,
    inputs_at: &dyn Fn(usize) -> Result<Vec<Tensor>>,
) -> Result<Option<remat::Policy>> {
    use remat::plan::{resolve, summary, Profile};
    if !policy.needs_plan() && !run.dry_run && run.memory_cap.is_none() {
        return Ok(Some(policy.clone()));
    }
    let (vars, device) = vars_and_device(model);
    let (profile, dry_peak) = remat::memory::peak_during(|| Profile::at_batch(model.graph(), inputs_at, &vars, batch, run.seed));
    let profile = profile?;
    let (fixed, held) = step_start(run, &device, optimizer, &profile, batch, inputs_at)?;
    let (resolved, plan) = resolve(policy, &profile, fixed, held, auto_budget(&device, run.memory_cap))?;
    if let (Some(cap), None, false) = (run.memory_cap, &plan, run.dry_run) {
        // A fixed policy under a cap: refused now if the planner says it cannot fit, where the
        // run would otherwise end at the allocation that crosses the cap.
        let need = fixed + profile.predict_policy(&resolved, held)?.peak;
        if need > cap {
            let least = profile.least_peak(held);
            bail!(
                "--policy {resolved} needs {:.1} MiB by the planner's prediction (state before the step {:.1} MiB), above --memory-cap {:.1} MiB; the least any checkpoint plan needs is {:.1} MiB ({}), and --policy auto picks the fastest plan that fits",
                mib(need),
                mib(fixed),
                mib(cap),
                mib(fixed + least.estimate.peak),
                least.policy()
            );
        }
    }
    if let Some(plan) = &plan {
        say!("{policy}: {} ({}), predicted {:.1} MiB in all", resolved, segments(plan.starts.len()), mib(fixed + plan.estimate.peak));
    }
    if !run.dry_run {
        return Ok(Some(resolved));
    }
    show!("{}", remat::plan::describe(&profile));
    show!("memory before a step (weights, optimizer state, data, inputs): {:.1} MiB", mib(fixed));
    let mut policies = vec![resolved.clone()];
    policies.extend([remat::Policy::Off, remat::Policy::Sqrt, remat::Policy::EveryN(2)].into_iter().filter(|q| *q != resolved));
    for q in policies {
        let e = profile.predict_policy(&q, held)?;
        show!("{q}: total {:.1} MiB; {}", mib(fixed + e.peak), summary(&e));
    }
    let least = profile.least_peak(held);
    show!("least memory: {} total {:.1} MiB; {}", least.policy(), mib(fixed + least.estimate.peak), summary(&least.estimate));
    show!("dry run: trained nothing; profiling used {:.1} MiB of heap beyond the model", mib(dry_peak));
    Ok(None)
}

/// Fails now, before any training, if `path` (given with `flag`) cannot be written: a directory,
/// a missing folder, no permission, or something that exists and is not a regular file (a device
/// such as /dev/full, a symlink, a pipe), which writing would replace or feed. Before, a bad
/// `--save` failed after the last step, and `--save /dev/full` turned the device into a file.
fn check_writable(path: &Path, flag: &str) -> Result<()> {
    if path.is_dir() {
        bail!("{flag} {} is a directory; give a file name", path.display());
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_file() {
            let kind = if meta.file_type().is_symlink() { "a symbolic link" } else { "not a regular file" };
            bail!("{flag} {} exists and is {kind}; give the path of a regular file (it would be replaced)", path.display());
        }
    }
    let probe = path.with_extension("probe");
    std::fs::File::create(&probe).with_context(|| format!("{flag} {}: cannot write there", path.display()))?;
    std::fs::remove_file(&probe).ok();
    Ok(())
}

/// The files a run writes (`--save`, its training snapshot, `--log-json`), checked before
/// training: each writable ([`check_writable`]) and no two the same (`--save X --log-json X`
/// would interleave a log with a snapshot).
fn check_outputs(run: &RunArgs) -> Result<()> {
    let training = run.save.as_deref().map(training_snapshot_path);
    let outputs: Vec<(&str, &Path)> =
        [("--save", run.save.as_deref()), ("--save's training snapshot", training.as_deref()), ("--log-json", run.log_json.as_deref())]
            .into_iter()
            .filter_map(|(flag, path)| Some((flag, path?)))
            .collect();
    for (i, &(flag, path)) in outputs.iter().enumerate() {
        check_writable(path, flag)?;
        if let Some((other, _)) = outputs[..i].iter().find(|(_, p)| same_file(p, path)) {
            bail!("{flag} and {other} are both {}; give each its own file", path.display());
        }
    }
    Ok(())
}

/// Whether two output paths name one file: equal as given, or in the same folder (symlinks and
/// `..` resolved) under the same name. [`check_writable`] has refused a symlink as the file itself.
fn same_file(a: &Path, b: &Path) -> bool {
    let resolved = |p: &Path| {
        let folder = p.parent().filter(|f| !f.as_os_str().is_empty()).unwrap_or(Path::new("."));
        Some(std::fs::canonicalize(folder).ok()?.join(p.file_name()?))
    };
    a == b || resolved(a).is_some_and(|x| Some(x) == resolved(b))
}

/// One line of `--log-json` after a training step.
#[derive(Serialize)]
struct StepRecord {
    step: usize,
    loss: f32,
    step_ms: f64,
    micro_batches: usize,
    heap_base_bytes: u64,
    heap_peak_delta_bytes: u64,
    rss_peak_delta_bytes: Option<u64>,
    /// Data-parallel ranks (the loss is their mean; memory is rank 0's).
    ranks: usize,
    /// The largest rank's step peak, with several ranks.
    #[serde(skip_serializing_if = "Option::is_none")]
    heap_peak_delta_max_bytes: Option<u64>,
    /// Time in gradient all-reduces this step, and the part the training thread waited for.
    #[serde(skip_serializing_if = "Option::is_none")]
    all_reduce_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    all_reduce_wait_ms: Option<f64>,
}

/// One line of `--log-json` after an evaluation.
#[derive(Serialize)]
struct EvalRecord {
    step: usize,
    eval_loss: f32,
    eval_batches: usize,
}

/// The command-line options every trainer shares.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// cpu, cuda or cuda:N (CUDA needs a build with --features cuda).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Write one JSON record per step to this file.
    #[arg(long)]
    pub log_json: Option<std::path::PathBuf>,
    /// Write the trained weights (and BatchNorm statistics) here as a safetensors snapshot.
    #[arg(long)]
    pub save: Option<std::path::PathBuf>,
    /// Also write the snapshot every N steps, with a training snapshot beside it
    /// (`<save>.train.safetensors`: weights, optimizer state, next step) that `--resume` continues.
    #[arg(long, requires = "save")]
    pub save_every: Option<usize>,
    /// Continue an interrupted run from its training snapshot: the losses and final weights are
    /// those of an uninterrupted run, bit for bit (same flags and --seed); --log-json appends.
    #[arg(long)]
    pub resume: Option<std::path::PathBuf>,
    /// Every N steps and after the last, print (and log) the loss in evaluation mode (no dropout,
    /// BatchNorm on its running statistics) on --eval-batches batches that training never uses:
    /// those the data stream would give after the last training step.
    #[arg(long)]
    pub eval_every: Option<usize>,
    #[arg(long, default_value_t = 2, requires = "eval_every")]
    pub eval_batches: usize,
    /// Gradient accumulation: N micro-batches of --batch per optimizer step (effective batch
    /// N x --batch); the gradient is the mean of the micro-batch gradients.
    #[arg(long, default_value_t = 1)]
    pub accumulate: usize,
    /// The dtype activations are computed and stored in: f32, bf16 or f16 (parameters, their
    /// gradients and the optimizer state stay f32), or bf16-weights (parameters and gradients
    /// bf16 too, optimizer moments f32).
    #[arg(long, default_value = "f32")]
    pub dtype: layers::Precision,
    /// f16 only: the initial loss scale (default 65536). A step whose gradients are not finite is
    /// skipped and the scale halved; after 2000 good steps in a row it doubles (PyTorch's
    /// GradScaler).
    #[arg(long)]
    pub loss_scale: Option<f64>,
    /// Predict the run's memory (per phase, for this policy and the fixed ones) and step time
    /// from a profile of the model's stages (one at a time), print it, and train nothing (so
    /// nothing to save, resume or log).
    #[arg(long, conflicts_with_all = ["save", "resume", "log_json"])]
    pub dry_run: bool,
    /// The memory the run may use, e.g. 8GiB: on the CPU allocations beyond it fail (an emulated
    /// smaller device), and `--policy auto` plans for it (without it, `auto` plans for the
    /// device's free memory less a tenth).
    #[arg(long, value_parser = remat::memory::parse_size)]
    pub memory_cap: Option<u64>,
    /// Data parallelism over N processes on this machine: re-runs this command under
    /// `mpirun -np N` (a build with `--features mpi`), each rank bound to its own cores and
    /// training on its shard of every batch (--batch is per rank). Already under mpirun, the
    /// ranks are mpirun's.
    #[arg(long, default_value_t = 1)]
    pub ranks: usize,
    /// With several ranks: ZeRO stage 1. Each rank keeps and updates the optimizer state of its
    /// share of the parameters only, then sends those parameters to the others; training
    /// snapshots gather the whole state on rank 0.
    #[arg(long)]
    pub shard_optimizer: bool,
}

/// The most held-out batches an evaluation runs (`--eval-batches`): each is a forward pass, and
/// 10^11 of them ran for days without a word.
const MAX_EVAL_BATCHES: usize = 10_000;

impl RunArgs {
    /// Refuses values the run could only ignore or misuse, before anything starts: counts of 0
    /// (`--save-every 0` never saved, `--eval-every 0` and `--eval-batches 0` never evaluated),
    /// `--eval-batches` beyond [`MAX_EVAL_BATCHES`], a loss scale f32 cannot hold.
    pub fn check(&self) -> Result<()> {
        let positive = [
            ("--save-every", self.save_every),
            ("--eval-every", self.eval_every),
            ("--eval-batches", Some(self.eval_batches)),
            ("--ranks", Some(self.ranks)),
            ("--accumulate", Some(self.accumulate)),
        ];
        for (flag, value) in positive {
            if value == Some(0) {
                bail!("{flag} must be at least 1");
            }
        }
        if self.eval_batches > MAX_EVAL_BATCHES {
            bail!("--eval-batches {} is more than {MAX_EVAL_BATCHES} (each is a forward pass)", self.eval_batches);
        }
        if let Some(scale) = self.loss_scale {
            if self.dtype != layers::Precision::F16 {
                bail!("--loss-scale applies to --dtype f16 only (this run: {})", self.dtype);
            }
            if !(scale.is_finite() && scale > 0.0 && scale <= f32::MAX as f64) {
                bail!("--loss-scale {scale} is not a positive number f32 can hold (at most {:e}): every step would overflow and be skipped", f32::MAX);
            }
        }
        Ok(())
    }
}

/// Dynamic loss scaling for f16, as PyTorch's `GradScaler`: backward starts from the loss times
/// `scale`; a step with non-finite gradients is skipped and the scale halved; after
/// `GROWTH_INTERVAL` good steps in a row it doubles.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaler {
    pub scale: f64,
    /// Good steps since the scale last changed.
    pub good_steps: u64,
}

impl LossScaler {
    pub const GROWTH_INTERVAL: u64 = 2000;

    /// After a step whose gradients were (`finite`) or were not all finite.
    fn after(&mut self, finite: bool) {
        if !finite {
            *self = LossScaler { scale: self.scale / 2.0, good_steps: 0 };
        } else if self.good_steps + 1 == Self::GROWTH_INTERVAL {
            *self = LossScaler { scale: self.scale * 2.0, good_steps: 0 };
        } else {
            self.good_steps += 1;
        }
    }
}

/// The data batches of optimizer step `step` under gradient accumulation: micro-batch `m` is
/// batch `step * accumulate + m`, which also keys its random draws (the trainers and the harness
/// alike; with `accumulate` 1, batch `step`).
pub fn micro_batches(step: u64, accumulate: usize) -> std::ops::Range<u64> {
    let n = accumulate as u64;
    step * n..(step + 1) * n
}

/// The gradients of an optimizer step's `micro_batches` micro-batches, accumulated under the loss
/// scale of `scaler` (f16), made ready for the update: the scaler told whether they are finite,
/// and, if they are, divided by the micro-batch count and the loss scale in place. Returns whether
/// the update goes ahead (false: a non-finite gradient, the step is skipped).
pub fn finish_gradients(grads: &mut GradStore, vars: &[candle_core::Var], micro_batches: usize, scaler: Option<&mut LossScaler>) -> Result<bool> {
    let scale = scaler.as_ref().map_or(1.0, |s| s.scale);
    if let Some(scaler) = scaler {
        let finite = all_finite(grads, vars)?;
        scaler.after(finite);
        if !finite {
            return Ok(false);
        }
    }
    let factor = 1.0 / (micro_batches as f64 * scale);
    if factor != 1.0 {
        layers::scale_grads(grads, vars, factor)?;
    }
    Ok(true)
}

/// PyTorch's initial scale, 2^16.
impl Default for LossScaler {
    fn default() -> Self {
        LossScaler { scale: 65536.0, good_steps: 0 }
    }
}

/// Whether every gradient of `vars` in `grads` is finite (a sum per gradient: an infinity or a
/// NaN anywhere makes it non-finite).
fn all_finite(grads: &GradStore, vars: &[candle_core::Var]) -> Result<bool> {
    for v in vars {
        if let Some(g) = grads.get(v) {
            if !g.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?.is_finite() {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// Where the training snapshot that goes with the weights snapshot `save` is written.
pub fn training_snapshot_path(save: &Path) -> std::path::PathBuf {
    save.with_extension("train.safetensors")
}

/// The tensor names of a training snapshot: the model's under their own names, the optimizer's
/// and the run's under these prefixes.
const OPTIMIZER: &str = "training.optimizer.";
const NEXT_STEP: &str = "training.next_step";
const SEED: &str = "training.seed";
const LOSS_SCALE: &str = "training.loss_scale";
const GOOD_STEPS: &str = "training.loss_scale_good_steps";

/// The metadata key of a training snapshot's [`RunConfig`].
const CONFIG: &str = "training.config";

/// The flags that decide what a run computes, kept in its training snapshots: a resumed run must
/// give the same ones, or it would continue another run (AdamW's moments dropped when resuming as
/// SGD, another batch size's data order). Where a run goes and what it writes may differ
/// (`--policy`: gradients are bit-identical under every policy; `--steps`, `--device`, the
/// output files, evaluation). The seed is checked on its own ([`load_training`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct RunConfig(std::collections::BTreeMap<String, String>);

impl RunConfig {
    /// The shared flags of `run` at (per-rank) batch `batch` on `ranks` ranks, and the trainer's
    /// own (`fields`: the flag and its value, e.g. `("--seq", "128")`).
    pub fn new(run: &RunArgs, batch: usize, ranks: usize, fields: &[(&str, String)]) -> Self {
        let shared =
            [("--batch", batch.to_string()), ("--dtype", run.dtype.to_string()), ("--accumulate", run.accumulate.to_string()), ("--ranks", ranks.to_string())];
        RunConfig(shared.into_iter().chain(fields.iter().cloned()).map(|(k, v)| (k.to_string(), v)).collect())
    }

    /// Fails naming the first flag whose value differs from `saved`'s (the snapshot's), with both.
    fn check_against(&self, saved: &RunConfig, snapshot: &Path) -> Result<()> {
        let flags: std::collections::BTreeSet<&String> = self.0.keys().chain(saved.0.keys()).collect();
        for flag in flags {
            let (now, then) = (self.0.get(flag), saved.0.get(flag));
            if now != then {
                let show = |v: Option<&String>| v.map_or("not given".to_string(), |v| v.clone());
                bail!(
                    "--resume {}: {flag} is {} in this run but was {} in the run that wrote the snapshot; resume with the same flags (only --policy, --steps, --device and the output files may change)",
                    snapshot.display(),
                    show(now),
                    show(then)
                );
            }
        }
        Ok(())
    }
}

/// Writes a training snapshot: every parameter and buffer, the optimizer's `state`, the next step,
/// the seed (the data and every random draw follow from the seed and the step), the f16 loss
/// scaler's state, and the run's `config` with a checksum in the metadata
/// ([`layers::write_snapshot`]). Written beside the target and renamed over it, so an interrupted
/// write keeps the previous one.
pub fn save_training(
    path: &Path,
    store: &layers::ParamStore,
    state: HashMap<String, Tensor>,
    next_step: usize,
    seed: u64,
    scaler: Option<LossScaler>,
    config: &RunConfig,
) -> Result<()> {
    let mut map = store.tensors();
    map.extend(state.into_iter().map(|(k, v)| (format!("{OPTIMIZER}{k}"), v)));
    map.insert(NEXT_STEP.into(), Tensor::new(next_step as i64, &Device::Cpu)?);
    map.insert(SEED.into(), Tensor::new(seed as i64, &Device::Cpu)?);
    if let Some(s) = scaler {
        map.insert(LOSS_SCALE.into(), Tensor::new(s.scale, &Device::Cpu)?);
        map.insert(GOOD_STEPS.into(), Tensor::new(s.good_steps as i64, &Device::Cpu)?);
    }
    let metadata = HashMap::from([(CONFIG.to_string(), serde_json::to_string(config)?)]);
    layers::write_snapshot(path, &map, metadata).with_context(|| format!("writing {}", path.display()))
}

/// Loads a training snapshot into the model, the optimizer and the loss scaler (where the run
/// has one), after checking its checksum, seed and configuration against this run's; returns the
/// step to continue from.
pub fn load_training(
    path: &Path,
    store: &layers::ParamStore,
    opt: &mut dyn layers::TrainOptimizer,
    seed: u64,
    scaler: Option<&mut LossScaler>,
    config: &RunConfig,
) -> Result<usize> {
    let ctx = || format!("--resume {}", path.display());
    let (tensors, metadata) = layers::read_snapshot(path, &Device::Cpu).with_context(ctx)?;
    let scalar = |name: &str| -> Result<i64> {
        let t = tensors.get(name).with_context(|| format!("{} is not a training snapshot (no `{name}`)", path.display()))?;
        Ok(t.to_scalar::<i64>()?)
    };
    let (next, saved_seed) = (scalar(NEXT_STEP)?, scalar(SEED)?);
    if saved_seed as u64 != seed {
        bail!("{} was written with --seed {saved_seed}; resume with the same seed (this run has {seed})", path.display());
    }
    match metadata.get(CONFIG) {
        Some(saved) => config.check_against(&serde_json::from_str(saved).with_context(ctx)?, path)?,
        None => say!("--resume {}: written before training snapshots kept their run's flags; make sure this run gives the same ones", path.display()),
    }
    if let Some(scaler) = scaler {
        let scale = tensors.get(LOSS_SCALE).with_context(|| format!("{} was not written by an f16 run (no loss scale)", path.display()))?;
        *scaler = LossScaler { scale: scale.to_scalar::<f64>()?, good_steps: scalar(GOOD_STEPS)? as u64 };
    }
    let state = tensors.iter().filter_map(|(k, v)| Some((k.strip_prefix(OPTIMIZER)?.to_string(), v.clone()))).collect();
    store.load_tensors(tensors, &path.display().to_string(), |n| (!n.starts_with("training.")).then(|| n.to_string()), |_| false).with_context(ctx)?;
    opt.set_state(&state).with_context(ctx)?;
    Ok(next as usize)
}

pub struct StepLog<'g> {
    group: &'g Group,
    /// Communication time when the last step was logged.
    comm: collective::CommTime,
    bar: ProgressBar,
    /// `--log-json` and its file.
    json: Option<(std::path::PathBuf, std::fs::File)>,
    times: Vec<f64>,
    steps: usize,
    save: Option<std::path::PathBuf>,
    save_every: Option<usize>,
    resume: Option<std::path::PathBuf>,
    seed: u64,
    eval_every: Option<usize>,
    eval_batches: usize,
    accumulate: usize,
    /// f16 runs only.
    scaler: Option<LossScaler>,
    config: RunConfig,
    /// What a data batch is, by number, where the data comes from files ([`StepLog::name_batches`]).
    batch_names: Option<Box<dyn Fn(u64) -> String + 'g>>,
}

/// "1 segment", "3 segments": what a log line says of a cut.
pub fn segments(n: usize) -> String {
    format!("{n} segment{}", if n == 1 { "" } else { "s" })
}

pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

impl<'g> StepLog<'g> {
    /// A log for `steps` optimizer steps of (micro-)batches of `batch` samples, with the JSON
    /// file, snapshot schedule and accumulation of `run`, on the ranks of `group` (rank 0 writes
    /// the log and the snapshots; gradients and losses are averaged over the ranks). `fields`:
    /// the trainer's own flags that decide what the run computes ([`RunConfig`]), which its
    /// training snapshots keep and a resume must match.
    pub fn new(steps: usize, batch: usize, run: &RunArgs, group: &'g Group, fields: &[(&str, String)]) -> Result<Self> {
        // `run` was checked by `launch` ([`RunArgs::check`]), before anything started.
        let loss_scale = run.loss_scale.unwrap_or(LossScaler::default().scale);
        if let Some(cap) = run.memory_cap {
            remat::memory::set_heap_cap(cap);
        }
        if run.accumulate > 1 {
            say!("accumulating {} micro-batches of {batch} per optimizer step: effective batch {}", run.accumulate, run.accumulate * batch);
        }
        let bar = ProgressBar::new(steps as u64).with_style(ProgressStyle::with_template("{bar:30} {pos}/{len} steps [{elapsed} < {eta}] {msg}")?);
        if group.is_root() {
            check_outputs(run)?;
        }
        // A resumed run appends to the log of the run it continues.
        let json = match run.log_json.as_ref().filter(|_| group.is_root()) {
            Some(p) => Some((
                p.clone(),
                std::fs::OpenOptions::new()
                    .create(true)
                    .write(true)
                    .append(run.resume.is_some())
                    .truncate(run.resume.is_none())
                    .open(p)
                    .with_context(|| format!("--log-json {}", p.display()))?,
            )),
            None => None,
        };
        Ok(StepLog {
            group,
            comm: group.comm_time(),
            bar,
            json,
            times: Vec::new(),
            steps,
            save: run.save.clone(),
            save_every: run.save_every,
            resume: run.resume.clone(),
            seed: run.seed,
            eval_every: run.eval_every,
            eval_batches: run.eval_batches,
            accumulate: run.accumulate,
            scaler: (run.dtype == layers::Precision::F16).then_some(LossScaler { scale: loss_scale, good_steps: 0 }),
            config: RunConfig::new(run, batch, group.world(), fields),
            batch_names: None,
        })
    }

    /// Names data batch `n` in errors (`names(n)`: e.g. the files it was read from), for a step
    /// whose gradients are not finite.
    pub fn name_batches(&mut self, names: impl Fn(u64) -> String + 'g) {
        self.batch_names = Some(Box::new(names));
    }

    /// With `--resume`, loads its training snapshot into the model and the optimizer and returns
    /// the step to continue from; 0 without.
    pub fn resume(&mut self, store: &layers::ParamStore, opt: &mut dyn layers::TrainOptimizer) -> Result<usize> {
        let Some(path) = &self.resume else { return Ok(0) };
        let next = load_training(path, store, opt, self.seed, self.scaler.as_mut(), &self.config)?;
        if next > self.steps {
            bail!("{} is at step {next}, beyond --steps {}", path.display(), self.steps);
        }
        self.bar.set_position(next as u64);
        say!("resumed from {} at step {next}", path.display());
        Ok(next)
    }

    /// After `step` (0-based): writes the weights snapshot (with `save_weights`, the model's own
    /// format) and the training snapshot when due: every `--save-every` steps and after the last.
    pub fn save_if_due(
        &self,
        step: usize,
        store: &layers::ParamStore,
        opt: &dyn layers::TrainOptimizer,
        save_weights: impl FnOnce(&Path) -> Result<()>,
    ) -> Result<()> {
        if self.save.is_none() || !self.due(step, self.save_every) {
            return Ok(());
        }
        // On every rank: a sharded optimizer gathers its state from all of them.
        let Some(state) = opt.snapshot_state()? else { return Ok(()) };
        let Some(path) = self.save.as_deref().filter(|_| self.group.is_root()) else { return Ok(()) };
        save_weights(path)?;
        save_training(&training_snapshot_path(path), store, state, step + 1, self.seed, self.scaler, &self.config)
    }

    /// Whether something done every `every` steps (if given) and after the last is due after `step`.
    fn due(&self, step: usize, every: Option<usize>) -> bool {
        let done = step + 1;
        done == self.steps || every.is_some_and(|n| n > 0 && done.is_multiple_of(n))
    }

    /// After `step` (0-based), when `--eval-every` says so: the mean evaluation-mode loss
    /// ([`layers::Model::evaluate`]) over the held-out batches, `inputs(n)` being the graph inputs
    /// of the data stream's batch `n` (those after the last training micro-batch are never
    /// trained on); logged.
    pub fn eval_if_due(&mut self, step: usize, model: &impl layers::Model, inputs: impl Fn(u64) -> Result<Vec<Tensor>>) -> Result<()> {
        if self.eval_every.is_none() || !self.due(step, self.eval_every) || self.eval_batches == 0 {
            return Ok(());
        }
        let mut total = 0.0;
        // The first batch after the last training step's micro-batches.
        let held_out = micro_batches(self.steps as u64, self.accumulate).start;
        for n in 0..self.eval_batches as u64 {
            total += model.evaluate(&inputs(held_out + n)?)? as f64;
        }
        let eval_loss = self.group.mean_of(total / self.eval_batches as f64)? as f32;
        self.bar.suspend(|| say!("eval after step {step}: loss {eval_loss:.4} ({} held-out batches)", self.eval_batches));
        self.write_json(&EvalRecord { step, eval_loss, eval_batches: self.eval_batches })
    }

    /// Appends `record` as one line to `--log-json`, if given; an error names the file (a full
    /// disk said only "No space left on device").
    fn write_json(&mut self, record: &impl Serialize) -> Result<()> {
        let Some((path, f)) = self.json.as_mut() else { return Ok(()) };
        writeln!(f, "{}", serde_json::to_string(record)?).and_then(|()| f.flush()).with_context(|| format!("--log-json {}", path.display()))
    }

    /// One measured optimizer step: forward and backward under `exec` of its `--accumulate`
    /// micro-batches (`inputs(n)`: the graph inputs of the data stream's batch `n`, for the
    /// batches of [`micro_batches`]), the
    /// gradients accumulated and averaged, then `update` with them; logged, and its loss (the
    /// micro-batches' mean) returned.
    pub fn train_step(
        &mut self,
        exec: &Executor,
        step: usize,
        inputs: impl Fn(u64) -> Result<Vec<Tensor>>,
        update: impl FnOnce(&GradStore) -> candle_core::Result<()>,
    ) -> Result<f32> {
        let scale = self.scaler.map_or(1.0, |s| s.scale);
        exec.set_loss_scale(scale);
        let mut meter = None;
        let (mut grads, mut total) = (GradStore::default(), 0f64);
        let batches = micro_batches(step as u64, self.accumulate);
        let last = batches.end - 1;
        let mut non_finite_losses = Vec::new();
        for n in batches.clone() {
            let inputs = inputs(n)?;
            meter.get_or_insert_with(|| Meter::start(inputs[0].device()));
            let out = parallel::accumulate(self.group, exec, &inputs, n, last, grads)?;
            let loss = out.loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
            if !loss.is_finite() {
                non_finite_losses.push(n);
            }
            total += loss as f64;
            grads = out.grads;
        }
        // Without a loss scaler (whose rule is to skip such a step), a non-finite gradient ends
        // the run before it reaches the weights: a NaN in the data otherwise trains on silently.
        if self.scaler.is_none() && !all_finite(&grads, exec.params())? {
            // The micro-batches whose loss was not finite, or where all were, every one of the step.
            let suspects = if non_finite_losses.is_empty() { batches.collect() } else { non_finite_losses };
            let named: Vec<String> = suspects
                .into_iter()
                .map(|n| match &self.batch_names {
                    Some(names) => format!("data batch {n}: {}", names(n)),
                    None => format!("data batch {n}"),
                })
                .collect();
            bail!(
                "step {step}: the gradients are not finite, so the weights were not updated; a NaN or an infinity in the data ({}), or a diverging run (a lower --lr may help)",
                named.join("; ")
            );
        }
        if finish_gradients(&mut grads, exec.params(), self.accumulate, self.scaler.as_mut())? {
            update(&grads)?;
        } else {
            let now = self.scaler.map_or(1.0, |s| s.scale);
            self.bar.suspend(|| say!("step {step}: gradients not finite at loss scale {scale}; update skipped, loss scale now {now}"));
        }
        drop(grads);
        let usage = meter.expect("at least one micro-batch").finish();
        let loss = self.group.mean_of(total / self.accumulate as f64)? as f32;
        self.log(step, loss, &usage)?;
        if !loss.is_finite() {
            bail!("step {step}: the loss is {loss}; training cannot go on (a lower --lr may help)");
        }
        Ok(loss)
    }

    fn log(&mut self, step: usize, loss: f32, usage: &Usage) -> Result<()> {
        self.times.push(usage.elapsed_ms);
        let rss = usage.rss_peak_delta.map_or("n/a".into(), |b| format!("{:.1} MiB", mib(b)));
        // `suspend` prints whether or not the bar is drawn (it is hidden when stderr is no terminal).
        self.bar.suspend(|| say!("step {step:>4}  loss {loss:.4}  {:>8.1} ms  peak +{:.1} MiB (rss +{rss})", usage.elapsed_ms, mib(usage.heap_peak_delta)));
        self.bar.set_message(format!("loss {loss:.3}"));
        self.bar.inc(1);
        let (now, before) = (self.group.comm_time(), std::mem::replace(&mut self.comm, self.group.comm_time()));
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let parallel = (self.group.world() > 1).then(|| (ms(now.all_reduce - before.all_reduce), ms(now.waited - before.waited)));
        let peaks = if self.group.world() > 1 { Some(self.group.min_max(usage.heap_peak_delta)?) } else { None };
        if self.json.is_some() {
            let rec = StepRecord {
                step,
                loss,
                step_ms: usage.elapsed_ms,
                micro_batches: self.accumulate,
                heap_base_bytes: usage.heap_base,
                heap_peak_delta_bytes: usage.heap_peak_delta,
                rss_peak_delta_bytes: usage.rss_peak_delta,
                ranks: self.group.world(),
                heap_peak_delta_max_bytes: peaks.map(|p| p.1),
                all_reduce_ms: parallel.map(|p| p.0),
                all_reduce_wait_ms: parallel.map(|p| p.1),
            };
            self.write_json(&rec)?;
        }
        Ok(())
    }

    /// Clears the bar; checks that the ranks' parameters (`store`) agree; prints the median step
    /// time (the first, warm-up step excluded), the time spent in all-reduces and where the
    /// snapshot went.
    pub fn finish(self, store: &layers::ParamStore) -> Result<()> {
        self.bar.finish_and_clear();
        parallel::check_in_sync(self.group, store)?;
        let comm = self.group.comm_time();
        if self.group.world() > 1 {
            let (busy, waited) = (comm.all_reduce.as_secs_f64() * 1e3, comm.waited.as_secs_f64() * 1e3);
            say!(
                "all-reduce: {busy:.1} ms in all-reduce calls; the training thread waited {waited:.1} ms for the means ({:.1} MiB of f32 per rank)",
                mib(comm.floats * 4)
            );
        }
        if self.times.len() > 1 {
            let mut t = self.times[1..].to_vec();
            t.sort_by(f64::total_cmp);
            say!("median step time after warm-up: {:.1} ms", t[t.len() / 2]);
        }
        if let Some(path) = &self.save {
            say!("saved snapshot to {}", path.display());
        }
        Ok(())
    }
}

/// The training losses of a `--log-json` file, in step order (evaluation lines skipped).
pub fn read_losses(path: &Path) -> Result<Vec<f32>> {
    read_log(path, "loss")
}

/// The evaluation losses of a `--log-json` file, in step order.
pub fn read_eval_losses(path: &Path) -> Result<Vec<f32>> {
    read_log(path, "eval_loss")
}

/// The values of `field` in the lines of a `--log-json` file that have it.
fn read_log(path: &Path, field: &str) -> Result<Vec<f32>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut values = Vec::new();
    for line in text.lines() {
        let record: serde_json::Value = serde_json::from_str(line).with_context(|| format!("{}: not a log line: {line}", path.display()))?;
        if let Some(v) = record.get(field).and_then(|v| v.as_f64()) {
            values.push(v as f32);
        }
    }
    Ok(values)
}

/// Heap peaks of one training step (forward and backward), in bytes above the heap before it.
#[derive(Clone, Copy, Debug)]
pub struct Peaks {
    /// The highest heap during the step.
    pub step: u64,
    /// The same less the parameter gradients held at that point: what checkpointing acts on
    /// (`remat::memory::Timeline::activation_peak`).
    pub activation: u64,
    /// The heap when the forward pass ended (the last stage's output computed).
    pub forward_end: u64,
    /// The highest heap during backward (recomputes included).
    pub backward: u64,
    /// Bytes of the parameter gradients at the end of the step.
    pub grads: u64,
}

/// The peaks of the second of two steps under `exec` (the first pays one-off allocations such
/// as per-thread buffers). Needs [`remat::memory::CountingAlloc`] as the global allocator.
pub fn second_step_peaks(exec: &Executor, inputs: impl Fn(u64) -> Vec<Tensor>) -> Result<Peaks> {
    let mut peaks = Peaks { step: 0, activation: 0, forward_end: 0, backward: 0, grads: 0 };
    for step in 0..2 {
        let inputs = inputs(step);
        let meter = Meter::start(inputs[0].device());
        let out = exec.step(&inputs, step)?;
        let usage = meter.finish();
        let events = &out.timeline.events;
        let forward = events.iter().take_while(|e| e.phase == remat::memory::Phase::Forward).count();
        let above = |b: u64| b.saturating_sub(usage.heap_base);
        peaks = Peaks {
            step: usage.heap_peak_delta,
            activation: out.timeline.activation_peak(usage.heap_base),
            forward_end: events[..forward].last().map_or(0, |e| above(e.bytes)),
            backward: events[forward..].iter().map(|e| above(e.window_peak)).max().unwrap_or(0),
            grads: events.last().map_or(0, |e| e.grad_bytes),
        };
    }
    Ok(peaks)
}

/// Fails unless a measured figure is within 10 % of the one committed with a test: a memory
/// regression fails it, and so does an improvement, whose change must then update the figure.
pub fn assert_near_figure(what: &str, measured: u64, committed: u64) {
    let ratio = measured as f64 / committed as f64;
    eprintln!("{what}: {measured} B measured, {committed} B committed ({ratio:.3}x)");
    assert!((0.9..=1.1).contains(&ratio), "{what}: measured {measured} B is {ratio:.3}x the committed {committed} B (allowed 0.9-1.1)");
}

/// The memory checks of a deep transformer, given its peaks under a policy: `sqrt` at least
/// halves the step peak, the activation peaks of `off` and `sqrt` are the committed figures, and
/// under `off` the heap during backward stays within the end-of-forward level plus the parameter
/// gradients plus 5 %: the gradients in flight (the executor frees each stage once its gradients
/// are propagated). A backward that kept gradients it no longer needs exceeds it: with the
/// dropout masks' gradients kept, as candle did for a composed dropout, it was 40-60 %.
/// `off_forward_end` is what `off` holds at the end of forward as the model's shapes give it (the
/// test derives it): the measurement must be within 5 % of it.
pub fn assert_deep_model_memory(peaks: impl Fn(&str) -> Peaks, off_forward_end: u64, off_activation: u64, sqrt_activation: u64) {
    assert!(remat::memory::heap_meter_installed());
    let (off, sqrt) = (peaks("off"), peaks("sqrt"));
    let ratio = off.forward_end as f64 / off_forward_end as f64;
    eprintln!("off: forward ends at {} B, {off_forward_end} B from the shapes ({ratio:.3}x)", off.forward_end);
    assert!((0.95..=1.05).contains(&ratio), "off: forward ends at {} B, {ratio:.3}x the {off_forward_end} B the shapes give", off.forward_end);
    // The executor's backward frees each stage once its gradients are propagated: the heap during
    // backward stays within the end-of-forward level plus the parameter gradients plus 5 %.
    let bound = off.forward_end + off.grads + off.forward_end * 5 / 100;
    eprintln!("off: forward ends at {} B, backward peaks at {} B, gradients {} B", off.forward_end, off.backward, off.grads);
    assert!(
        off.backward <= bound,
        "off: backward peaks at {} B, above the end of forward {} B + gradients {} B + 5 %",
        off.backward,
        off.forward_end,
        off.grads
    );
    eprintln!("step peak: off {} B, sqrt {} B ({:.2}x)", off.step, sqrt.step, sqrt.step as f64 / off.step as f64);
    assert!(sqrt.step * 2 <= off.step, "sqrt peak {} B is more than half of off {} B", sqrt.step, off.step);
    assert_near_figure("off activation peak", off.activation, off_activation);
    assert_near_figure("sqrt activation peak", sqrt.activation, sqrt_activation);
}

/// A snapshot of `saved` loaded into `fresh`, a model built from another seed: their evaluation
/// outputs (`eval`) and buffers (BatchNorm statistics: `saved`'s must have moved, e.g. by a
/// training step) differ before loading and are bit-identical after.
pub fn assert_snapshot_round_trip<M>(
    saved: &M,
    fresh: &M,
    store: impl Fn(&M) -> &layers::ParamStore,
    eval: impl Fn(&M) -> Vec<f32>,
    load: impl Fn(&M, &Path) -> std::result::Result<(), layers::SnapshotError>,
) {
    let dir = std::env::temp_dir().join(format!("snapshot-round-trip-{}-{:?}", std::process::id(), std::thread::current().id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("own.safetensors");
    store(saved).save(&path).unwrap();
    let buffers = |m: &M| store(m).buffer_bits().unwrap();
    assert_ne!(eval(fresh), eval(saved), "different seeds must give different models");
    let saved_buffers = buffers(saved);
    if !saved_buffers.is_empty() {
        assert!(saved_buffers != buffers(fresh), "the running statistics must have moved, or loading them proves nothing");
    }
    load(fresh, &path).unwrap();
    assert_eq!(eval(fresh), eval(saved), "evaluation outputs differ after loading");
    assert!(buffers(fresh) == saved_buffers, "buffers differ after loading");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The device named on a command line: `cpu`, `cuda` or `cuda:N`; a clear error when this build
/// has no CUDA support.
pub fn device(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        d if d == "cuda" || d.starts_with("cuda:") => {
            // One process per GPU (data parallelism): plain `cuda` is this rank's GPU.
            let local = std::env::var("LOCAL_RANK").ok().and_then(|r| r.parse().ok()).unwrap_or(0);
            let ordinal: usize = d.strip_prefix("cuda:").map_or(Ok(local), str::parse).context("--device cuda:N needs a number")?;
            if !candle_core::utils::cuda_is_available() {
                bail!("--device {d}: this build has no CUDA support (build with --features cuda)");
            }
            Ok(Device::new_cuda(ordinal)?)
        }
        other => bail!("unknown device `{other}`; valid devices: cpu, cuda, cuda:N"),
    }
}

/// Runs the trainer binary `bin` with `args` and `--log-json`; it must succeed. Returns the
/// per-step training losses and what it printed on stderr.
pub fn run_logged(bin: &str, args: &[&str]) -> (Vec<f32>, String) {
    let log = std::env::temp_dir().join(format!("run-logged-{}-{:x}.jsonl", std::process::id(), args_hash(args)));
    let out = std::process::Command::new(bin).args(args).args(["--log-json", log.to_str().unwrap()]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{bin} {args:?}: {err}");
    let losses = read_losses(&log).unwrap();
    std::fs::remove_file(&log).unwrap();
    (losses, err)
}

/// A name for `args` (tests of one binary run in parallel, each with its own files).
fn args_hash(args: &[&str]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    args.hash(&mut h);
    h.finish()
}

/// Fails unless the mean of the last five losses is below the mean of the first five by `margin`.
pub fn assert_loss_falls(losses: &[f32], margin: f32, what: &str) {
    let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
    let (first, last) = (mean(&losses[..5]), mean(&losses[losses.len() - 5..]));
    assert!(last < first - margin, "{what}: the loss went from {first:.3} to {last:.3} (needs a fall of {margin}): {losses:?}");
}

/// Runs the trainer binary `bin` (with its model and size flags `args`) for 4 steps straight, and
/// for 2 steps with a training snapshot followed by `--resume` to step 4: the per-step losses and
/// the final weights snapshot must be the same bits. Before training snapshots, `--init` restarted
/// at step 0 with fresh optimizer state and its losses differed from step 1 on.
pub fn assert_resume_is_bit_identical(bin: &str, args: &[&str]) {
    let name = Path::new(bin).file_name().unwrap().to_string_lossy().into_owned();
    let dir = std::env::temp_dir().join(format!("resume-{name}-{}-{:x}", std::process::id(), args_hash(args)));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(bin).args(args).args(["--policy", "sqrt"]).args(extra).output().unwrap();
        assert!(out.status.success(), "{bin} {args:?} {extra:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    run(&["--steps", "4", "--save", &path("straight.safetensors"), "--log-json", &path("straight.json")]);
    run(&["--steps", "2", "--save", &path("cut.safetensors"), "--save-every", "2", "--log-json", &path("cut.json")]);
    run(&["--steps", "4", "--save", &path("cut.safetensors"), "--resume", &path("cut.train.safetensors"), "--log-json", &path("cut.json")]);
    let losses = |name: &str| read_losses(&dir.join(name)).unwrap().into_iter().map(f32::to_bits).collect::<Vec<_>>();
    assert_eq!(losses("straight.json").len(), 4);
    assert_eq!(losses("cut.json"), losses("straight.json"), "losses of the resumed run");
    let weights = |name: &str| -> std::collections::BTreeMap<String, Vec<u32>> {
        candle_core::safetensors::load(dir.join(name), &Device::Cpu).unwrap().into_iter().map(|(n, t)| (n, layers::f32_bits(&t).unwrap())).collect()
    };
    assert_eq!(weights("cut.safetensors"), weights("straight.safetensors"), "final weights of the resumed run");
    // Snapshots are readable by all, as other tools write files (they were 0600).
    #[cfg(unix)]
    for name in ["cut.safetensors", "cut.train.safetensors"] {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(dir.join(name)).unwrap().permissions().mode() & 0o777, 0o644, "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The command lines of README.md that run the binary `bin` (`cargo run ... --bin train-gpt2 --
/// ARGS`, `cargo run ... -p bench-harness -- ARGS`, `target/release/train-gpt2 ARGS`; lines ending
/// in `\` joined, `# comments` dropped): each one's ARGS, for a test to check that they still parse.
pub fn readme_commands(bin: &str) -> Vec<Vec<String>> {
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    let text = std::fs::read_to_string(&readme).unwrap_or_else(|e| panic!("{}: {e}", readme.display()));
    let joined = text.replace("\\\n", " ");
    let starts = [format!("--bin {bin} -- "), format!("target/release/{bin} ")];
    let mut commands = Vec::new();
    for line in joined.lines() {
        let line = line.split(" # ").next().unwrap_or("").trim();
        let harness = bin == "bench-harness" && line.starts_with("cargo run") && line.contains("-p bench-harness");
        let args = match starts.iter().find_map(|s| line.split_once(s.as_str())) {
            Some((_, args)) => args,
            None if harness => line.split_once(" -- ").map_or("", |(_, args)| args),
            None => continue,
        };
        // Up to the end of the command: a pipe, a redirection or the next command.
        commands.push(
            args.split_whitespace()
                .take_while(|w| !["&&", "||", "|", ";"].contains(w) && !w.starts_with('>') && !w.starts_with("2>"))
                .map(str::to_string)
                .collect(),
        );
    }
    commands
}

/// Fails unless every README command line of `bin` ([`readme_commands`]; at least `at_least` of
/// them) still parses: run with `--help` last, which the parser answers only once every flag
/// before it exists and its value reads.
pub fn assert_readme_commands_parse(bin: &str, path: &str, at_least: usize) {
    let commands = readme_commands(bin);
    assert!(commands.len() >= at_least, "README.md has {} command lines of {bin}, expected {at_least} or more", commands.len());
    for args in commands {
        let out = std::process::Command::new(path).args(&args).arg("--help").output().unwrap();
        assert!(out.status.success(), "README.md: {bin} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    }
}

#[cfg(test)]
mod tests {
    use super::LossScaler;

    /// f16's scale doubles after `GROWTH_INTERVAL` good steps in a row, and an overflow halves it
    /// and restarts the count (PyTorch's `GradScaler`). Before, no test reached the growth.
    #[test]
    fn the_loss_scale_grows_after_its_interval_and_halves_on_overflow() {
        let mut s = LossScaler::default();
        for _ in 0..LossScaler::GROWTH_INTERVAL - 1 {
            s.after(true);
        }
        assert_eq!(s, LossScaler { scale: 65536.0, good_steps: LossScaler::GROWTH_INTERVAL - 1 });
        s.after(true);
        assert_eq!(s, LossScaler { scale: 131072.0, good_steps: 0 });
        s.after(true);
        s.after(false);
        assert_eq!(s, LossScaler { scale: 65536.0, good_steps: 0 });
    }
}
