//! `bench-harness`: runs models x checkpointing policies, each configuration in a fresh process;
//! checks every policy's gradients, `off`'s too, bit for bit against plain candle; measures peak
//! memory and step time; writes `results/<profile>-<device>/matrix.{json,csv,md}`.
//!
//! It measures; it does not train to convergence (that is what the trainers are for).

mod baseline;
mod measure;
mod plot;
mod predict;
mod projection;
mod report;
mod results;
mod table;
mod table24;
mod workloads;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use measure::{Record, Spread, Status};
use remat::memory::CountingAlloc;
use remat::Policy;
use report::{gib, mib};
use results::{Matrix, Meta};
use std::path::PathBuf;
use std::process::Command;
use workloads::Workload;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[derive(Parser)]
#[command(about = "Checkpointing benchmark: models x policies, bit-exact gradient checks, memory and time")]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    matrix: MatrixArgs,
}

#[derive(Subcommand)]
enum Cmd {
    /// Check the device before a long run: tensor ops, conv2d, backward, the memory meter, and a
    /// bit-exact gradient check; prints one JSON line and fails on any problem.
    Selftest {
        #[arg(long, default_value = "cpu")]
        device: String,
    },
    /// Predict one model of the `full` profile at its size and print the projection as JSON
    /// (the matrix runs this for the article's table).
    #[command(hide = true)]
    ProjectOne {
        #[arg(long)]
        model: String,
        #[command(flatten)]
        common: Common,
    },
    /// Measure one configuration and print its record as JSON (the matrix runs this per config).
    #[command(hide = true)]
    RunOne {
        #[arg(long)]
        model: String,
        #[arg(long)]
        policy: Policy,
        /// Time the steps only: no prediction, no gradient check (the interleaved timing rounds).
        #[arg(long)]
        time_only: bool,
        /// Measure and predict, but skip the gradient check (where two more models do not fit).
        #[arg(long)]
        no_check: bool,
        /// Predict only: profile the stages and print the record with the prediction, run no step.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        common: Common,
    },
}

#[derive(Args, Clone)]
struct Common {
    /// Configuration set: smoke (tiny, seconds), cpu (minutes per model), full (the article's sizes).
    #[arg(long)]
    profile: Option<String>,
    /// Timed steps per configuration (after one warm-up step).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Override every selected model's batch size.
    #[arg(long)]
    batch: Option<usize>,
    /// Override every selected model's input size: sequence length, or image side.
    #[arg(long)]
    input_size: Option<usize>,
    /// Gradient accumulation: micro-batches of --batch per optimizer step; a timed step is all
    /// of them and the update (default: the profile's, 1 but in gpt2-24gb).
    #[arg(long)]
    accumulate: Option<usize>,
    /// Train every selected model with this optimizer (sgd, adamw, adafactor) instead of its
    /// default (SGD for the ResNets, AdamW for the others).
    #[arg(long)]
    optimizer: Option<layers::OptimizerKind>,
    /// The dtype activations are computed in (f32, bf16, f16; parameters stay f32); default:
    /// the profile's, f32 but in gpt2-24gb. f16 runs with dynamic loss scaling.
    #[arg(long)]
    dtype: Option<layers::Precision>,
    /// Emulate a smaller memory (e.g. 24GiB): on the CPU allocations beyond this much heap fail;
    /// on a GPU the rest of the device memory is held.
    #[arg(long, value_parser = remat::memory::parse_size)]
    memory_cap: Option<u64>,
    /// Data parallelism: every configuration runs on N ranks under mpirun (a build with
    /// `--features mpi`), each with its own batch (--batch is per rank) and its share of the
    /// cores; records the largest rank's step peak and the time in gradient all-reduces.
    /// Results go to results/<profile>-<device>-ranksN.
    #[arg(long, default_value_t = 1)]
    ranks: usize,
    /// Give freed memory back to the OS at once (mimalloc's purge delay 0) instead of keeping it
    /// for the next step: resident memory stays near the live heap, which near the machine's
    /// memory decides whether a run is killed, at the cost of page faults every step.
    #[arg(long)]
    return_freed_memory: bool,
    /// With --ranks: shard the optimizer state over the ranks (ZeRO stage 1): each keeps and
    /// updates its share. Results go to results/<profile>-<device>-ranksN-sharded.
    #[arg(long)]
    shard_optimizer: bool,
    /// Negative control: the gradient check's recomputes draw fresh dropout keys instead of
    /// replaying the forward's, so every policy that recomputes dropout must fail the check.
    /// Exists only to prove the check can fail (tests); never use it for results.
    #[arg(long, hide = true)]
    no_rng_replay: bool,
}

#[derive(Args)]
struct MatrixArgs {
    /// Which matrix to run: `models` (every model x every applicable policy of the profile),
    /// `depth` (the depth sweep: off and sqrt on ever deeper GPT-2 block stacks), `all` (both),
    /// `gpt2-24gb` (GPT-2 small to XL at batch 1 with accumulation, in four precision/optimizer
    /// variants, predicted and measured against 24 GiB), or `render` (rewrite the CSV, Markdown,
    /// TABLE.md and plots from matrix.json; run nothing).
    #[arg(long, default_value = "all")]
    matrix: String,
    /// Only models whose name starts with one of these (comma-separated), e.g. gpt2,resnet50.
    #[arg(long, value_delimiter = ',')]
    models: Vec<String>,
    /// Only these policies (comma-separated).
    #[arg(long, value_delimiter = ',')]
    policies: Vec<Policy>,
    /// Results folder; default results/<profile>-<device>.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Rerun configurations that already have a result.
    #[arg(long)]
    force: bool,
    /// Extra timing rounds per model after its configurations: every policy again, interleaved
    /// (off, sqrt, ..., off, sqrt, ...), each in a fresh process; each policy's time / off is then
    /// reported as the median and range over this run's ratio and the rounds'.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Also run each configuration in another framework, side by side: `pytorch` runs
    /// scripts/torch_baseline.py (PyTorch eager, torch.utils.checkpoint on the same segments).
    #[arg(long, value_parser = ["pytorch"])]
    baseline: Option<String>,
    /// The Python that has torch, torchvision and transformers (for --baseline pytorch).
    #[arg(long, default_value = "python3")]
    python: String,
    /// Predict every configuration and run none: the planner's step peak (forward and backward,
    /// and what it is made of) and time, printed, nothing saved. gpt2-24gb: every configuration
    /// that has its calibration (gpt2-small's record of the same variant and policy, from an
    /// earlier run into the same folder), recorded as not run.
    #[arg(long)]
    dry_run: bool,
    #[command(flatten)]
    common: Common,
}

impl Common {
    /// What the flags change in every selected workload.
    fn overrides(&self) -> workloads::Overrides {
        workloads::Overrides {
            batch: self.batch,
            input_size: self.input_size,
            accumulate: self.accumulate,
            optimizer: self.optimizer,
            dtype: self.dtype,
            shard_optimizer: self.shard_optimizer,
        }
    }
}

impl Common {
    /// The default results folder: `results/<profile>-<device>`, `-ranksN` with data parallelism
    /// (`-ranksN-sharded` with the optimizer state sharded).
    fn results_dir(&self, profile: &str) -> PathBuf {
        let sharded = if self.shard_optimizer { "-sharded" } else { "" };
        let ranks = if self.ranks > 1 { format!("-ranks{}{sharded}", self.ranks) } else { String::new() };
        PathBuf::from(format!("results/{profile}-{}{ranks}", self.device.replace(':', "")))
    }

    /// The profile that fits the device unless one was named.
    fn profile(&self) -> String {
        self.profile.clone().unwrap_or_else(|| if self.device == "cpu" { "cpu" } else { "full" }.into())
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Some(Cmd::RunOne { model, policy, time_only, no_check, dry_run, common }) => {
            let mode = match (dry_run, time_only, no_check) {
                (true, _, _) => One::DryRun,
                (_, true, _) => One::TimeOnly,
                (_, _, true) => One::Unchecked,
                _ => One::Full,
            };
            run_one(&model, &policy, mode, &common)
        }
        Some(Cmd::ProjectOne { model, common }) => project_one(&model, &common),
        Some(Cmd::Selftest { device }) => selftest(&device),
        None => run_matrix(cli.matrix),
    }
}

/// What a `run-one` process does.
#[derive(Clone, Copy, PartialEq, Eq)]
enum One {
    /// Timed steps and the gradient check.
    Full,
    /// Timed steps and the prediction, no gradient check.
    Unchecked,
    /// Timed steps only (a timing round).
    TimeOnly,
    /// The prediction only.
    DryRun,
}

fn project_one(model: &str, common: &Common) -> Result<()> {
    let dev = trainkit::device(&common.device)?;
    let w = workloads::profile("full")?.into_iter().find(|w| w.model == model).with_context(|| format!("model `{model}` is not in profile `full`"))?;
    println!("{}", serde_json::to_string(&projection::project(&w, &dev, common.seed)?)?);
    Ok(())
}

/// Runs `project-one` for every model of the article's table that `models` selects (all where
/// it is empty), in fresh processes, into the matrix; a projection already there is kept unless
/// `force`.
fn project_all(matrix: &mut Matrix, models: &[String], common: &Common, force: bool) {
    for model in projection::MODELS.iter().filter(|m| models.is_empty() || models.iter().any(|s| m.starts_with(s.as_str()))) {
        if !force && matrix.projections.iter().any(|p| p.model == *model) {
            continue;
        }
        let exe = std::env::current_exe().expect("own executable");
        let mut cmd = Command::new(exe);
        cmd.args(["project-one", "--model", model, "--seed", &common.seed.to_string(), "--device", &common.device]);
        die_with_parent(&mut cmd);
        let projected = cmd.output().map_err(anyhow::Error::from).and_then(|out| {
            let stdout = String::from_utf8_lossy(&out.stdout);
            match stdout.lines().last().and_then(|l| serde_json::from_str::<projection::Projection>(l).ok()) {
                Some(p) if out.status.success() => Ok(p),
                _ => bail!("{}", child_error(&String::from_utf8_lossy(&out.stderr), out.status)),
            }
        });
        match projected {
            Ok(p) => {
                let p = projection::Projection { command: this_command(), ..p };
                let off = p.rows.first().map_or(0, |r| r.total_bytes);
                trainkit::say!("projected {model} at batch {} ({}): off {:.1} GB", p.batch, p.input, off as f64 / 1e9);
                matrix.put_projection(p);
            }
            Err(e) => trainkit::say!("projection of {model} failed: {e:#}"),
        }
    }
}

fn run_one(model: &str, policy: &Policy, mode: One, common: &Common) -> Result<()> {
    let dev = trainkit::device(&common.device)?;
    let group = trainkit::Group::from_launcher(&dev)?;
    trainkit::or_abort(&group, measure_one(model, policy, mode, common, &group, &dev))
}

/// `run-one` on one rank of `group`, on `dev`: the first rank prints the record.
fn measure_one(model: &str, policy: &Policy, mode: One, common: &Common, group: &trainkit::Group, dev: &candle_core::Device) -> Result<()> {
    // Held while the configuration is measured: the device memory beyond the cap.
    let held = match common.memory_cap {
        Some(cap) => hold_beyond(dev, cap)?,
        None => None,
    };
    let w = workloads::profile(&common.profile())?
        .into_iter()
        .chain(workloads::depth_sweep(&common.profile())?)
        .find(|w| w.model == model)
        .with_context(|| format!("model `{model}` is not in profile `{}`", common.profile()))?
        .overridden(common.overrides());
    let steps = if mode == One::DryRun { 0 } else { common.steps };
    let mut rec = measure::run(&w, policy, steps, common.seed, dev, &common.device, common.memory_cap, mode != One::TimeOnly, group)?;
    // The cap is for the measured configuration only: the check builds two more models.
    drop(held);
    remat::memory::set_heap_cap(u64::MAX);
    if !group.is_root() {
        return Ok(());
    }
    if mode == One::Full {
        // A budget is checked as the plan it resolved to (one process's step: the ranks'
        // agreement is the parameter check in `measure::run`).
        let checked: Policy = if rec.plan.is_empty() { policy.clone() } else { rec.plan.parse()? };
        measure::check(&mut rec, &w, &checked, common.seed, dev, !common.no_rng_replay)?;
    }
    println!("{}", serde_json::to_string(&rec)?);
    Ok(())
}

fn selftest(device_name: &str) -> Result<()> {
    use candle_core::{DType, Tensor, Var};
    let dev = trainkit::device(device_name)?;
    let counter = remat::memory::Counter::for_device(&dev);
    counter.reset_peak();
    let base = counter.current();
    let a = Tensor::arange(0f32, 64.0, &dev)?.reshape((8, 8))?;
    let matmul = a.matmul(&a.t()?)?.sum_all()?.to_scalar::<f32>()?;
    let expected: f32 = (0..8).flat_map(|i| (0..8).map(move |j| (0..8).map(|k| ((8 * i + k) * (8 * j + k)) as f32).sum::<f32>())).sum();
    anyhow::ensure!(matmul == expected, "matmul gave {matmul}, expected {expected}");
    let x = Var::from_tensor(&Tensor::ones((1, 2, 6, 6), DType::F32, &dev)?)?;
    let w = Tensor::ones((3, 2, 3, 3), DType::F32, &dev)?;
    let y = x.as_tensor().conv2d(&w, 1, 2, 1, 1)?; // (1, 3, 3, 3)
    let grads = y.sum_all()?.backward()?;
    let g = grads.get(x.as_tensor()).context("conv2d backward gave no gradient")?.sum_all()?.to_scalar::<f32>()?;
    anyhow::ensure!(g > 0.0, "conv2d input gradient sums to {g}");
    counter.synchronize();
    let peak = counter.peak().saturating_sub(base);
    anyhow::ensure!(peak > 0, "the memory meter saw no allocation");
    let w = workloads::profile("smoke")?.into_iter().find(|w| w.model == "gpt2-tiny").context("gpt2-tiny in smoke")?;
    let mut rec = measure::run(&w, &Policy::Sqrt, 1, 0, &dev, device_name, None, true, &trainkit::Group::single())?;
    measure::check(&mut rec, &w, &Policy::Sqrt, 0, &dev, true)?;
    anyhow::ensure!(rec.grads_bit_identical, "gpt2-tiny sqrt: {} gradient elements differ from plain candle", rec.grads_differing);
    let report = serde_json::json!({
        "device": device_name, "matmul": matmul, "conv2d_input_grad_sum": g, "meter_peak_bytes": peak,
        "reserved_bytes": counter.reserved(), "gpt2_tiny_sqrt_bit_identical": rec.grads_bit_identical,
    });
    trainkit::show!("{report}");
    Ok(())
}

/// Emulates a device with `cap` bytes: on the CPU, allocations beyond `cap` bytes of heap fail; on
/// a GPU, everything free beyond `cap` is allocated and held (returned; dropping it releases it).
fn hold_beyond(device: &candle_core::Device, cap: u64) -> Result<Option<candle_core::Tensor>> {
    match device {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(d) => {
            let (free, _total) = d.cuda_stream().context().mem_get_info()?;
            let hold = (free as u64).saturating_sub(cap) as usize;
            Ok(Some(candle_core::Tensor::zeros(hold, candle_core::DType::U8, device)?))
        }
        _ => {
            remat::memory::set_heap_cap(cap);
            Ok(None)
        }
    }
}

fn run_matrix(mut args: MatrixArgs) -> Result<()> {
    let (models, depth) = match args.matrix.as_str() {
        "all" => (true, true),
        "models" => (true, false),
        "depth" => (false, true),
        "render" => (false, false),
        workloads::GPT2_24GB => {
            gpt2_24gb_defaults(&mut args.common)?;
            (true, false)
        }
        other => bail!("unknown matrix `{other}`; valid: all, models, depth, render, gpt2-24gb (narrow them with --models and --policies)"),
    };
    let common = &args.common;
    trainkit::device(&common.device)?;
    if common.steps == 0 || common.batch == Some(0) || common.input_size == Some(0) || common.accumulate == Some(0) {
        bail!("--steps, --batch, --input-size and --accumulate must be at least 1");
    }
    if common.ranks == 0 {
        bail!("--ranks must be at least 1");
    }
    trainkit::parallel::check_sharding(common.shard_optimizer, common.ranks)?;
    if args.baseline.is_some() && common.ranks > 1 {
        bail!("--baseline runs PyTorch in one process; it cannot be combined with --ranks");
    }
    if args.baseline.is_some()
        && (common.accumulate.is_some_and(|n| n > 1) || common.optimizer.is_some() || common.dtype.is_some_and(|d| d != layers::Precision::F32))
    {
        bail!(
            "--baseline runs one f32 micro-batch per step with each model's default optimizer; it cannot be combined with --accumulate, --optimizer or --dtype"
        );
    }
    let profile = common.profile();
    let mut selected = Vec::new();
    if models {
        selected.extend(workloads::profile(&profile)?);
    }
    if depth {
        selected.extend(workloads::depth_sweep(&profile)?);
    }
    if !models && !depth {
        let dir = args.out.clone().unwrap_or_else(|| common.results_dir(&profile));
        let matrix = Matrix::load(&dir)?.with_context(|| format!("{} has no matrix.json to render", dir.display()))?;
        report::save(&matrix, &dir)?;
        trainkit::say!("rendered {}", dir.display());
        return Ok(());
    }
    let workloads: Vec<Workload> = selected
        .into_iter()
        .filter(|w| args.models.is_empty() || args.models.iter().any(|m| w.model.starts_with(m.as_str())))
        .map(|w| w.overridden(common.overrides()))
        .collect();
    if workloads.is_empty() {
        bail!("--models {:?} matches no model of profile `{profile}`", args.models);
    }
    let configs: Vec<(Workload, Policy)> = workloads
        .iter()
        .flat_map(|w| {
            let chosen = if args.policies.is_empty() { w.policies() } else { args.policies.iter().filter(|p| w.applies(p)).cloned().collect() };
            chosen.into_iter().map(move |p| (w.clone(), p))
        })
        .collect();
    if configs.is_empty() {
        bail!(
            "--models {:?} with --policies {:?} selects no configuration of profile `{profile}` (before-downsample applies to ResNet and U-Net only)",
            args.models,
            args.policies
        );
    }
    let dir = args.out.clone().unwrap_or_else(|| common.results_dir(&profile));
    let mut matrix = match Matrix::load(&dir) {
        Ok(m) => m.unwrap_or_default(),
        // An unreadable file (a run killed mid-write before writes became atomic, a hand edit)
        // must not block a fresh run: --force sets it aside.
        Err(e) if args.force => {
            let aside = dir.join("matrix.json.unreadable");
            std::fs::rename(dir.join("matrix.json"), &aside)?;
            trainkit::say!("{e:#}; moved to {} and starting afresh", aside.display());
            Matrix::default()
        }
        Err(e) => return Err(e.context("rerun with --force to set it aside and start afresh")),
    };
    let mismatched = other_configurations(&matrix, &workloads, common, &profile);
    if !mismatched.is_empty() {
        if !args.force {
            bail!(
                "{} holds results of another configuration ({}); a resume would mix them: use another --out, or --force to replace them",
                dir.display(),
                mismatched.join("; ")
            );
        }
        let keep = |model: &str| workloads.iter().all(|w| w.model != model) && matrix.meta.profile == profile;
        matrix.records.retain(|r| keep(&r.model));
        matrix.baselines.retain(|b| keep(&b.model));
    }
    let mut ran_any = false;
    let mut statuses: Vec<(String, Status)> = Vec::new();
    let python = match &args.baseline {
        Some(_) => match baseline::available(&args.python) {
            Ok(()) => Some(args.python.as_str()),
            Err(why) => {
                trainkit::say!("no PyTorch baseline: {why}; going on without it");
                None
            }
        },
        None => None,
    };

    let bar = ProgressBar::new(configs.len() as u64).with_style(ProgressStyle::with_template("{bar:30} {pos}/{len} configs [{elapsed} < {eta}] {msg}")?);
    let mut ran_models: Vec<&Workload> = Vec::new();
    let dry_run = args.dry_run && profile != workloads::GPT2_24GB;
    for (i, (w, policy)) in configs.iter().enumerate() {
        if dry_run {
            let rec = spawn_one(w, policy, common, &profile, One::DryRun);
            bar.suspend(|| trainkit::say!("{}", dry_summary(&rec)));
            bar.inc(1);
            continue;
        }
        let have = matrix.find(&w.model, &policy.to_string()).is_some();
        let have_baseline = python.is_none() || !baseline::MODELS.contains(&w.model.as_str()) || matrix.find_baseline(&w.model, &policy.to_string()).is_some();
        if !args.force && have && have_baseline {
            bar.inc(1);
            continue;
        }
        if !ran_any {
            // The files describe the run that produced their records: a resume that runs
            // nothing keeps the earlier command and commit.
            matrix.meta = meta(&profile);
            ran_any = true;
        }
        if args.force || !have {
            bar.set_message(format!("{} {policy}", w.model));
            let mut rec = if profile == workloads::GPT2_24GB {
                match run_predicted(&matrix, w, policy, common, &profile, args.dry_run)? {
                    Some(rec) => rec,
                    None => {
                        bar.inc(1);
                        continue;
                    }
                }
            } else {
                spawn_one(w, policy, common, &profile, One::Full)
            };
            bar.suspend(|| trainkit::say!("{}", summary(&rec, matrix.find(&w.model, "off"))));
            statuses.push((format!("{} {policy}", w.model), rec.status));
            rec.command = this_command();
            matrix.put(rec);
            if !ran_models.iter().any(|m| m.model == w.model) {
                ran_models.push(w);
            }
        }
        if let (Some(python), Some(ours)) = (python, matrix.find(&w.model, &policy.to_string()).filter(|r| r.status == Status::Ok)) {
            if baseline::MODELS.contains(&w.model.as_str()) {
                bar.set_message(format!("{} {policy} in PyTorch", w.model));
                let b = baseline::Baseline { command: this_command(), ..baseline::run(python, ours, w.input_size, common.steps, common.seed) };
                bar.suspend(|| trainkit::say!("{}", baseline_summary(&b, ours)));
                matrix.put_baseline(b);
            }
        }
        matrix.save_json(&dir)?;
        bar.inc(1);
        let model_done = configs.get(i + 1).is_none_or(|(next, _)| next.model != w.model);
        if model_done && args.rounds > 0 && ran_models.iter().any(|m| m.model == w.model) {
            bar.set_message(format!("{}: {} interleaved timing rounds", w.model, args.rounds));
            let policies: Vec<Policy> = configs.iter().filter(|(c, _)| c.model == w.model).map(|(_, p)| p.clone()).collect();
            time_rounds(&mut matrix, w, &policies, args.rounds, common, &profile);
            matrix.save_json(&dir)?;
        }
    }
    bar.finish_and_clear();
    if dry_run {
        return Ok(());
    }
    if profile == "cpu" || profile == "full" {
        project_all(&mut matrix, &args.models, common, args.force);
    }
    report::save(&matrix, &dir)?;
    trainkit::say!("results in {}", dir.display());
    // An `oom` is a result; an error is not, and neither is a run where every configuration ran out.
    let failed: Vec<&str> = statuses.iter().filter(|(_, s)| *s == Status::Error).map(|(c, _)| c.as_str()).collect();
    if !failed.is_empty() {
        bail!("{} of {} configurations failed: {}", failed.len(), statuses.len(), failed.join(", "));
    }
    if !statuses.is_empty() && statuses.iter().all(|(_, s)| *s == Status::Oom) {
        bail!("every configuration ran out of memory");
    }
    Ok(())
}

/// `--matrix gpt2-24gb`: the profile, sequence 256 on the CPU (a step of GPT-2 XL at 1024 takes
/// minutes on two cores) and 1024 elsewhere, and a memory cap of 24 GiB, or on the CPU what this
/// machine can give if that is less.
fn gpt2_24gb_defaults(common: &mut Common) -> Result<()> {
    if common.profile.as_deref().is_some_and(|p| p != workloads::GPT2_24GB) {
        bail!("--matrix gpt2-24gb runs its own profile; drop --profile");
    }
    common.profile = Some(workloads::GPT2_24GB.into());
    let cpu = common.device == "cpu";
    common.input_size = common.input_size.or(Some(if cpu { 256 } else { 1024 }));
    const GIB_24: u64 = 24 << 30;
    // The harness, the OS and the page cache need some of what is available.
    let machine = trainkit::available_memory().map(|b| b.saturating_sub(3 << 30));
    common.memory_cap = common.memory_cap.or(Some(if cpu { machine.map_or(GIB_24, |m| m.min(GIB_24)) } else { GIB_24 }));
    Ok(())
}

/// A `gpt2-24gb` configuration: predicted first ([`predict`], calibrated on gpt2-small's record
/// of the same variant and policy), skipped where the prediction exceeds the memory cap, run
/// otherwise. The gradient check needs two models and a copy of every gradient beside them, so
/// it runs only where that fits the cap (four times the parameters' f32 bytes, with room for the
/// activations). `dry_run`: nothing runs, and a configuration that cannot be predicted (no
/// calibration) gets no record.
fn run_predicted(matrix: &Matrix, w: &Workload, policy: &Policy, common: &Common, profile: &str, dry_run: bool) -> Result<Option<Record>> {
    let variant = w.model.split('/').nth(1).unwrap_or_default();
    let small = format!("gpt2-small/{variant}");
    // From the whole profile: --models may have left gpt2-small out of this run.
    let small_workload = workloads::profile(profile)?.into_iter().find(|c| c.model == small).map(|c| c.overridden(common.overrides()));
    let calibration = if w.model == small {
        None
    } else {
        let rec = matrix.find(&small, &policy.to_string()).filter(|r| r.status == Status::Ok);
        small_workload.as_ref().zip(rec)
    };
    let prediction = predict::predict(w, policy, calibration)?;
    let cap = common.memory_cap.expect("set by gpt2_24gb_defaults");
    let state = prediction.params + prediction.grads + prediction.optimizer;
    let total = prediction.total();
    let skipped = |error: String| Record { status: Status::Skipped, error, ..Record::new(w, policy, &common.device) };
    let mut rec = match total {
        None if dry_run => return Ok(None),
        Some(t) if dry_run => skipped(format!("dry run (predicted {:.1} GiB)", gib(t))),
        Some(t) if t > cap => skipped(format!("does not fit (predicted {:.1} GiB > cap {:.1} GiB)", gib(t), gib(cap))),
        None if state > cap => skipped(format!("does not fit (its state alone is {:.1} GiB > cap {:.1} GiB)", gib(state), gib(cap))),
        _ => {
            let check_fits = prediction.params * 4 + prediction.activations.unwrap_or(0) < cap;
            let mut rec = spawn_one(w, policy, common, profile, if check_fits { One::Full } else { One::Unchecked });
            rec.grads_checked = check_fits && rec.status == Status::Ok;
            rec
        }
    };
    rec.predicted = Some(prediction);
    rec.predicted_total_bytes = total;
    Ok(Some(rec))
}

/// What in the results folder was measured under another configuration than this run's (profile,
/// or a model's batch, input, device, threads or timed steps): a description of each, empty if all
/// match. Records are matched by model and policy, so mixing them would compare unlike runs.
fn other_configurations(matrix: &Matrix, workloads: &[Workload], common: &Common, profile: &str) -> Vec<String> {
    let mut out = Vec::new();
    if !matrix.records.is_empty() && matrix.meta.profile != profile {
        out.push(format!("profile `{}`, this run `{profile}`", matrix.meta.profile));
    }
    let threads = candle_core::utils::get_num_threads();
    for r in &matrix.records {
        let Some(w) = workloads.iter().find(|w| w.model == r.model) else { continue };
        let mut diff = Vec::new();
        if r.batch != w.batch {
            diff.push(format!("batch {} vs {}", r.batch, w.batch));
        }
        if r.accumulate != w.accumulate {
            diff.push(format!("accumulate {} vs {}", r.accumulate, w.accumulate));
        }
        if r.dtype != w.dtype.to_string() {
            diff.push(format!("dtype {} vs {}", r.dtype, w.dtype));
        }
        if !r.optimizer.is_empty() && r.optimizer != w.optimizer().to_string() {
            diff.push(format!("optimizer {} vs {}", r.optimizer, w.optimizer()));
        }
        if r.shard_optimizer != w.shard_optimizer {
            diff.push(format!("optimizer sharded {} vs {}", r.shard_optimizer, w.shard_optimizer));
        }
        if r.input != w.input() {
            diff.push(format!("input {} vs {}", r.input, w.input()));
        }
        if r.device != common.device {
            diff.push(format!("device {} vs {}", r.device, common.device));
        }
        if r.threads != threads {
            diff.push(format!("threads {} vs {threads}", r.threads));
        }
        if r.status == Status::Ok && r.timed_steps != common.steps {
            diff.push(format!("timed steps {} vs {}", r.timed_steps, common.steps));
        }
        if !diff.is_empty() {
            out.push(format!("{} {}: {}", r.model, r.policy, diff.join(", ")));
        }
    }
    out
}

/// Times every policy of `w` again, `rounds` times interleaved (off, p1, p2, ..., off, p1, ...),
/// each in a fresh process, and records each policy's time / off per round beside the ratio of
/// the measuring run: run-to-run drift then shows as a spread instead of a wrong ratio.
fn time_rounds(matrix: &mut Matrix, w: &Workload, policies: &[Policy], rounds: usize, common: &Common, profile: &str) {
    let ok = |m: &Matrix, p: &Policy| m.find(&w.model, &p.to_string()).is_some_and(|r| r.status == Status::Ok);
    if !ok(matrix, &Policy::Off) {
        return;
    }
    let timed: Vec<&Policy> = policies.iter().filter(|p| ok(matrix, p)).collect();
    let mut ratios: Vec<Vec<f64>> = timed
        .iter()
        .map(|p| {
            let (r, off) = (matrix.find(&w.model, &p.to_string()).unwrap(), matrix.find(&w.model, "off").unwrap());
            vec![r.step_ms_median / off.step_ms_median]
        })
        .collect();
    for _ in 0..rounds {
        let times: Vec<Option<f64>> =
            timed.iter().map(|p| Some(spawn_one(w, p, common, profile, One::TimeOnly)).filter(|r| r.status == Status::Ok).map(|r| r.step_ms_median)).collect();
        let off = timed.iter().position(|p| **p == Policy::Off).and_then(|i| times[i]);
        for (ratio, t) in ratios.iter_mut().zip(&times) {
            if let (Some(t), Some(off)) = (t, off) {
                ratio.push(t / off);
            }
        }
    }
    for (p, ratio) in timed.iter().zip(ratios) {
        if **p != Policy::Off {
            let mut rec = matrix.find(&w.model, &p.to_string()).unwrap().clone();
            rec.time_vs_off = Spread::of(ratio);
            matrix.put(rec);
        }
    }
}

fn baseline_summary(b: &baseline::Baseline, ours: &Record) -> String {
    if b.status != Status::Ok {
        return format!("{:<14} {:<18} PyTorch {}: {}", b.model, b.policy, b.status, b.error);
    }
    format!(
        "{:<14} {:<18} PyTorch peak {:>11} {:>8.0} ms; ours / PyTorch: peak {:.2}x, time {:.2}x",
        b.model,
        b.policy,
        mib(b.step_peak_bytes),
        b.step_ms_median,
        ours.step_peak_bytes as f64 / b.step_peak_bytes.max(1) as f64,
        ours.step_ms_median / b.step_ms_median
    )
}

/// Runs one configuration in a fresh process, so one run's peak never leaks into another.
fn spawn_one(w: &Workload, policy: &Policy, common: &Common, profile: &str, mode: One) -> Record {
    let exe = std::env::current_exe().expect("own executable");
    let mut cmd = if common.ranks > 1 { trainkit::parallel::mpirun(common.ranks, &exe) } else { Command::new(exe) };
    cmd.args(["run-one", "--model", &w.model, "--policy", &policy.to_string(), "--profile", profile]).args([
        "--steps",
        &common.steps.to_string(),
        "--seed",
        &common.seed.to_string(),
        "--device",
        &common.device,
    ]);
    let o = common.overrides();
    let flags = [
        ("--memory-cap", common.memory_cap.map(|b| b.to_string())),
        ("--batch", o.batch.map(|b| b.to_string())),
        ("--input-size", o.input_size.map(|n| n.to_string())),
        ("--accumulate", o.accumulate.map(|n| n.to_string())),
        ("--optimizer", o.optimizer.map(|k| k.to_string())),
        ("--dtype", o.dtype.map(|d| d.to_string())),
    ];
    for (flag, value) in flags {
        if let Some(v) = value {
            cmd.args([flag, &v]);
        }
    }
    if common.no_rng_replay {
        cmd.arg("--no-rng-replay");
    }
    if common.shard_optimizer {
        cmd.arg("--shard-optimizer");
    }
    if common.return_freed_memory {
        cmd.env("MIMALLOC_PURGE_DELAY", "0");
    }
    match mode {
        One::Full => {}
        One::TimeOnly => {
            cmd.arg("--time-only");
        }
        One::Unchecked => {
            cmd.arg("--no-check");
        }
        One::DryRun => {
            cmd.arg("--dry-run");
        }
    }
    die_with_parent(&mut cmd);
    let failed = |status: Status, error: String| Record { status, error, ..Record::new(w, policy, &common.device) };
    let out = match cmd.output() {
        Ok(out) => out,
        Err(e) => return failed(Status::Error, format!("could not start: {e}")),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    if out.status.success() {
        if let Some(rec) = stdout.lines().last().and_then(|l| serde_json::from_str::<Record>(l).ok()) {
            return rec;
        }
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Our allocator names the phase of a refused allocation; otherwise the runtime's line.
    let oom_line = stderr
        .lines()
        .find(|l| l.starts_with(remat::memory::CAP_REFUSAL))
        .or_else(|| stderr.lines().find(|l| ["memory allocation of", "out of memory", "OUT_OF_MEMORY"].iter().any(|s| l.contains(s))));
    #[cfg(unix)]
    let killed = std::os::unix::process::ExitStatusExt::signal(&out.status) == Some(9);
    #[cfg(not(unix))]
    let killed = false;
    match (oom_line, killed) {
        (Some(line), _) => failed(Status::Oom, line.trim().to_string()),
        (None, true) => failed(Status::Oom, "killed by SIGKILL (the kernel's OOM killer?)".into()),
        _ => failed(Status::Error, child_error(&stderr, out.status)),
    }
}

/// What a failed child process said: anyhow's "Error: ..." line, not the backtrace
/// RUST_BACKTRACE appends; else its last line; else its exit status.
fn child_error(stderr: &str, status: std::process::ExitStatus) -> String {
    let line = stderr.lines().find_map(|l| l.strip_prefix("Error: ")).or_else(|| stderr.lines().rev().find(|l| !l.trim().is_empty())).unwrap_or("").trim();
    if line.is_empty() {
        format!("exited with {status}")
    } else {
        line.to_string()
    }
}

/// Makes the child get SIGKILL when the harness dies, however it dies (`kill -9` included), so a
/// child never runs on (or holds a GPU) without it. Linux's parent-death signal; elsewhere nothing.
pub fn die_with_parent(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let parent = std::process::id();
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have died before the call: then nobody would send the signal.
                if libc::getppid() as u32 != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

/// A dry run's line: the prediction of one configuration, per phase.
fn dry_summary(r: &Record) -> String {
    match &r.estimate {
        Some(e) if r.status == Status::Skipped => {
            let plan = if r.plan.is_empty() { String::new() } else { format!(" [{}]", r.plan) };
            format!("{:<14} {:<18} predicted {}{plan}", r.model, r.policy, remat::plan::summary(e))
        }
        _ => format!("{:<14} {:<18} {}: {}", r.model, r.policy, r.status, r.error),
    }
}

fn summary(r: &Record, off: Option<&Record>) -> String {
    if r.status != Status::Ok {
        return format!("{:<14} {:<18} {}: {}", r.model, r.policy, r.status, r.error);
    }
    let vs_off = off
        .filter(|o| r.policy != "off" && o.status == Status::Ok && o.step_peak_bytes > 0)
        .map(|o| format!(" ({:.2}x off peak, {:.2}x off time)", r.step_peak_bytes as f64 / o.step_peak_bytes as f64, r.step_ms_median / o.step_ms_median))
        .unwrap_or_default();
    let grads = match (r.grads_checked, r.grads_bit_identical) {
        (false, _) => "grads not checked",
        (true, true) => "grads = plain candle bit for bit",
        (true, false) => "GRADS DIFFER FROM PLAIN CANDLE",
    };
    let predicted = r
        .predicted_peak_bytes
        .map(|p| format!(" (predicted {}, {:+.1}%)", mib(p), (p as f64 / r.step_peak_bytes.max(1) as f64 - 1.0) * 100.0))
        .unwrap_or_default();
    let plan = if r.plan.is_empty() { String::new() } else { format!(" [{}]", r.plan) };
    format!(
        "{:<14} {:<18} peak {:>11}{predicted} act {:>11} {:>8.0} ms{vs_off}; {grads}{plan}",
        r.model,
        r.policy,
        mib(r.step_peak_bytes),
        mib(r.activation_peak_bytes),
        r.step_ms_median
    )
}

/// This harness command line, as results name what made them.
fn this_command() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

fn meta(profile: &str) -> Meta {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo.lines().find_map(|l| l.strip_prefix("model name")).map(|l| l.trim_start_matches([' ', '\t', ':']).to_string());
    // The project's own repository, wherever the harness runs from.
    let project = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(project)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short", "HEAD"]).filter(|c| !c.is_empty()).unwrap_or_else(|| "unknown".into());
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    Meta {
        machine: format!(
            "{} ({} CPUs visible, candle threads {})",
            cpu.unwrap_or_else(|| std::env::consts::ARCH.into()),
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            candle_core::utils::get_num_threads()
        ),
        candle_version: env!("CANDLE_VERSION").into(),
        git_commit: if dirty { format!("{commit}-dirty") } else { commit },
        command: this_command(),
        profile: profile.into(),
    }
}
