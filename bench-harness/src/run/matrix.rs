//! `--matrix models`, `depth`, `all` and `gpt2-24gb`: the configurations selected, each run in a
//! fresh process ([`super::child`]) into the results folder, resumable (what is there is kept
//! unless `--force`), with PyTorch beside them (`--baseline`), interleaved timing rounds, and the
//! reports written at the end.
//!
//! The matrices' other layers: [`crate::workloads`] (the configurations), [`crate::measure::one`]
//! (`run-one`: one configuration measured) and [`crate::report`] (the folder's files, written by
//! [`crate::report::save`]: `matrix.csv` and `matrix.md` there, [`crate::report::table`],
//! [`crate::report::plot`]).

use super::baseline::{self, Measure};
use super::child::spawn_one;
use super::lock::lock;
use super::rounds::{rounds_missing, time_rounds, Timing};
use super::{fits_24gb, projection, Execution, Existing};
use crate::cli::{Common, MatrixArgs, MatrixKind};
use crate::measure::{self, One};
use crate::report;
use crate::report::record::Baseline;
use crate::report::record::{Record, Status};
use crate::report::results::{machine, meta, same_processor, this_command, Matrix};
use crate::report::units::mib;
use crate::workloads::{self, Profile, Workload};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use remat::{Policy, PolicyRequest};
use std::path::{Path, PathBuf};

/// One configuration of the matrix: a workload under a policy.
type Config = (Workload, PolicyRequest);

/// Runs the matrix `args` asks for (or renders its folder).
pub fn run(mut args: MatrixArgs) -> Result<()> {
    // `--matrix gpt2-24gb`, or its profile named with another matrix.
    let asks_24gb = args.matrix.fits_24gb().or(args.common.profile.filter(|p| p.asks_24gb()));
    if let Some(profile) = asks_24gb {
        fits_24gb::defaults(&mut args.common, profile)?;
    }
    check(&args)?;
    let profile = args.common.profile();
    let dir = args.out.clone().unwrap_or_else(|| args.common.results_dir(profile));
    if args.matrix == MatrixKind::Render {
        let matrix = Matrix::load(&dir)?
            .with_context(|| format!("{} has no matrix.json to render", dir.display()))?;
        let _lock = lock(&dir)?;
        report::save(&matrix, &dir)?;
        trainkit::say!("rendered {}", dir.display());
        return Ok(());
    }
    let (workloads, configs) = select(&args, profile)?;
    // A dry run writes nothing into the folder; a measuring run holds it until its report.
    let _lock = if args.dry_run { None } else { Some(lock(&dir)?) };
    let matrix = open(&dir, &args, &workloads, profile)?;
    let measured =
        |w: &Workload| matrix.records.iter().any(|r| r.model == w.model && r.status == Status::Ok);
    if args.retime && !workloads.iter().any(measured) {
        bail!(
            "--retime: {} holds no measured configuration of the selected models to time again",
            dir.display()
        );
    }
    let mut run = Run { matrix, args: &args, profile, dir, statuses: Vec::new(), ran_any: false };
    // gpt2-24gb and llm-24gb predict every configuration anyway: their dry run records them as
    // not run.
    let execution =
        if args.dry_run && !profile.asks_24gb() { Execution::DryRun } else { Execution::Measure };
    run.all(&configs, execution)?;
    if execution == Execution::DryRun {
        return Ok(());
    }
    let Run { mut matrix, statuses, dir, .. } = run;
    if matches!(profile, Profile::Cpu | Profile::Full) {
        let existing = if args.force { Existing::Replace } else { Existing::Keep };
        projection::project_all(&mut matrix, &args.models, &args.common, existing);
    }
    report::save(&matrix, &dir)?;
    trainkit::say!("results in {}", dir.display());
    // An `oom` is a result; an error is not, and neither is a run where every configuration ran
    // out.
    let failed: Vec<&str> =
        statuses.iter().filter(|(_, s)| *s == Status::Error).map(|(c, _)| c.as_str()).collect();
    if !failed.is_empty() {
        bail!(
            "{} of {} configurations failed: {}",
            failed.len(),
            statuses.len(),
            failed.join(", ")
        );
    }
    if !statuses.is_empty() && statuses.iter().all(|(_, s)| *s == Status::Oom) {
        bail!("every configuration ran out of memory");
    }
    Ok(())
}

/// The most timing rounds a run takes (`--rounds`).
const MAX_ROUNDS: usize = 1000;

/// Refuses flags that cannot go together, before anything runs.
fn check(args: &MatrixArgs) -> Result<()> {
    let common = &args.common;
    common.device.open()?;
    if common.steps == 0
        || common.batch == Some(0)
        || common.input_size == Some(0)
        || common.accumulate == Some(0)
    {
        bail!("--steps, --batch, --input-size and --accumulate must be at least 1");
    }
    if common.ranks == 0 {
        bail!("--ranks must be at least 1");
    }
    // Unchecked, every configuration would be recorded as "could not start: No such file or
    // directory", naming no program.
    if common.ranks > 1 && args.matrix != MatrixKind::Render && !on_path("mpirun") {
        bail!(
            "--ranks {} runs each configuration under mpirun, which is not installed (not found \
             on PATH): install Open MPI (apt-get install openmpi-bin; a build with --features mpi \
             also needs libopenmpi-dev libclang-dev)",
            common.ranks
        );
    }
    // Each round runs every policy again, each micro-batch a forward and backward pass: beyond
    // these a run would never end, and a product of counts could wrap.
    if args.rounds > MAX_ROUNDS {
        bail!("--rounds {} is more than {MAX_ROUNDS} (each reruns every policy)", args.rounds);
    }
    trainkit::args::check_accumulate(common.accumulate.unwrap_or(1), common.batch.unwrap_or(1))?;
    let state = trainkit::parallel::OptimizerState::from_flag(common.shard_optimizer);
    trainkit::parallel::check_sharding(state, common.ranks)?;
    if args.models.iter().any(|m| m.trim().is_empty()) {
        bail!(
            "--models {}: an empty model name (a stray comma?) would select every model",
            args.models.join(",")
        );
    }
    if args.retime
        && (args.rounds == 0
            || !(args.policies.is_empty()
                || args.policies.contains(&PolicyRequest::Fixed(Policy::Off))))
    {
        bail!(
            "--retime takes the times again in --rounds rounds (at least 1), each policy against \
             `off`: keep `off` among --policies"
        );
    }
    if let (Some(python), None) = (&args.python, args.baseline) {
        bail!(
            "--python needs --baseline: {python} would run PyTorch beside ours (--baseline \
             pytorch), and without --baseline nothing runs it"
        );
    }
    if args.baseline.is_some() && common.ranks > 1 {
        bail!("--baseline runs PyTorch in one process; it cannot be combined with --ranks");
    }
    if args.baseline.is_some()
        && (common.accumulate.is_some_and(|n| n > 1)
            || common.optimizer.is_some()
            || common.dtype.is_some_and(|d| d != trainable::Precision::F32))
    {
        bail!(
            "--baseline runs one f32 micro-batch per step with each model's default optimizer; it \
             cannot be combined with --accumulate, --optimizer or --dtype"
        );
    }
    Ok(())
}

/// Whether `program` is an executable file in a folder of PATH, where a command finds it.
fn on_path(program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).any(|dir| {
        std::fs::metadata(dir.join(program))
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

/// The workloads of the matrix's kind and profile that `--models` selects, with the command
/// line's overrides, and every (workload, policy) to run: each workload's policies, or those of
/// `--policies` that apply to it.
fn select(args: &MatrixArgs, profile: Profile) -> Result<(Vec<Workload>, Vec<Config>)> {
    let mut selected = Vec::new();
    if matches!(args.matrix, MatrixKind::All | MatrixKind::Models)
        || args.matrix.fits_24gb().is_some()
    {
        selected.extend(workloads::profile(profile));
    }
    if matches!(args.matrix, MatrixKind::All | MatrixKind::Depth) {
        selected.extend(workloads::depth_sweep(profile));
    }
    let names: Vec<String> = selected.iter().map(|w| w.model.clone()).collect();
    let workloads: Vec<Workload> = by_name(selected, &args.models)
        .into_iter()
        .map(|w| w.overridden(args.common.overrides()))
        .collect();
    if workloads.is_empty() {
        bail!(no_model(args, profile, &names));
    }
    let configs: Vec<Config> = workloads
        .iter()
        .flat_map(|w| {
            let chosen: Vec<PolicyRequest> = if args.policies.is_empty() {
                let mut chosen: Vec<PolicyRequest> =
                    w.policies().into_iter().map(PolicyRequest::from).collect();
                chosen.extend(w.budget.map(PolicyRequest::Budget));
                // At full size, what fits a 24 GiB card: the planner's plan for one too.
                if (profile.asks_24gb() || profile == Profile::Full)
                    && !w.model.starts_with(workloads::DEPTH_PREFIX)
                {
                    chosen.push(PolicyRequest::Budget(workloads::CARD_BYTES));
                }
                chosen
            } else {
                args.policies
                    .iter()
                    .filter(|p| p.fixed().is_none_or(|p| w.applies(p)))
                    .cloned()
                    .collect()
            };
            chosen.into_iter().map(move |p| (w.clone(), p))
        })
        .collect();
    if configs.is_empty() {
        bail!(
            "--models {:?} with --policies {:?} selects no configuration of profile `{profile}` \
             (before-downsample applies to ResNet and U-Net only; +keep= to models that run the \
             ops it names: matmul and attention in GPT-2 and BERT, conv in ResNet and U-Net)",
            args.models,
            args.policies
        );
    }
    Ok((workloads, configs))
}

/// Why `--models` selects nothing from `names`, the models of the matrix's kind at `profile`:
/// the depth matrix takes its own GPT-2 block stacks only, not the profile's models.
fn no_model(args: &MatrixArgs, profile: Profile, names: &[String]) -> String {
    let models = args.models.join(",");
    let names = names.join(", ");
    match args.matrix {
        MatrixKind::Depth if names.is_empty() => format!(
            "--matrix depth: profile `{profile}` has no depth sweep (the profiles smoke, cpu and \
             full have one)"
        ),
        MatrixKind::Depth => format!(
            "--models {models} matches none of the models --matrix depth takes: the depth sweep \
             runs its own GPT-2 block stacks of growing depth, at profile `{profile}`: {names} \
             (leave --models out to run them all, or use --matrix models for the profile's \
             models)"
        ),
        MatrixKind::All => format!(
            "--models {models} matches no model of profile `{profile}` or of its depth sweep; \
             they are: {names}"
        ),
        _ => format!("--models {models} matches no model of profile `{profile}`; it has: {names}"),
    }
}

/// The results folder's matrix, to resume: refused where it holds results of another
/// configuration (they would be compared as if alike) unless `--force`, which drops them and
/// sets an unreadable file aside.
fn open(dir: &Path, args: &MatrixArgs, workloads: &[Workload], profile: Profile) -> Result<Matrix> {
    let mut matrix = match Matrix::load(dir) {
        Ok(m) => m.unwrap_or_default(),
        // An unreadable file (a hand edit, a disk that filled) must not block a fresh run:
        // --force sets it aside.
        Err(e) if args.force => {
            let aside = dir.join("matrix.json.unreadable");
            std::fs::rename(dir.join("matrix.json"), &aside)?;
            trainkit::say!("{e:#}; moved to {} and starting afresh", aside.display());
            Matrix::default()
        }
        Err(e) => return Err(e.context("rerun with --force to set it aside and start afresh")),
    };
    let ours = machine();
    let mismatched = other_configurations(&matrix, workloads, &args.common, profile, &ours);
    if !mismatched.is_empty() {
        if !args.force {
            bail!(
                "{} holds results of another configuration ({}); a resume would mix them: use \
                 another --out, or --force to replace them",
                dir.display(),
                mismatched.join("; ")
            );
        }
        let keep = |model: &str| {
            workloads.iter().all(|w| w.model != model)
                && matrix.meta.profile == profile.name()
                && same_processor(&matrix.meta.machine, &ours)
        };
        matrix.records.retain(|r| keep(&r.model));
        matrix.baselines.retain(|b| keep(&b.model));
    }
    Ok(matrix)
}

/// One matrix run in progress: the results so far and how each configuration ended.
struct Run<'a> {
    matrix: Matrix,
    args: &'a MatrixArgs,
    profile: Profile,
    dir: PathBuf,
    statuses: Vec<(String, Status)>,
    /// Whether a configuration has run yet (the results' metadata then names this run).
    ran_any: bool,
}

impl Run<'_> {
    /// Every configuration in order, under a progress bar; after a model's last one, its timing
    /// rounds. [`Execution::DryRun`]: each predicted and printed, nothing saved.
    fn all(&mut self, configs: &[Config], execution: Execution) -> Result<()> {
        let (args, common, profile) = (self.args, &self.args.common, self.profile);
        let python = match &args.baseline {
            Some(_) => match baseline::available(args.python()) {
                Ok(()) => Some(args.python()),
                Err(why) => {
                    trainkit::say!("no PyTorch baseline: {why}; going on without it");
                    None
                }
            },
            None => None,
        };
        let bar = ProgressBar::new(configs.len() as u64).with_style(ProgressStyle::with_template(
            "{bar:30} {pos}/{len} configs [{elapsed} < {eta}] {msg}",
        )?);
        let mut ran_models: Vec<&str> = Vec::new();
        for (i, (w, policy)) in configs.iter().enumerate() {
            if execution == Execution::DryRun {
                let rec = spawn_one(w, policy, common, (profile, None), One::DryRun);
                bar.suspend(|| trainkit::say!("{}", dry_summary(&rec)));
                bar.inc(1);
                continue;
            }
            if !args.retime && self.one(w, policy, python, &bar)? {
                ran_models.push(&w.model);
            }
            bar.inc(1);
            let model_done = configs.get(i + 1).is_none_or(|(next, _)| next.model != w.model);
            if let (true, true, Some(python)) = (model_done, args.compiled(), python) {
                self.compile_sweep(w, python, &bar)?;
            }
            if !model_done || args.rounds == 0 {
                continue;
            }
            let policies: Vec<PolicyRequest> = configs
                .iter()
                .filter(|(c, _)| c.model == w.model)
                .map(|(_, p)| p.clone())
                .collect();
            // A run interrupted during a model's rounds measured its configurations but stored
            // no rounds: this one takes them.
            if args.retime
                || ran_models.contains(&w.model.as_str())
                || rounds_missing(&self.matrix, &w.model, &policies, python.is_some())
            {
                bar.set_message(format!("{}: {} interleaved timing rounds", w.model, args.rounds));
                let timing = Timing { rounds: args.rounds, replace: args.retime };
                time_rounds(&mut self.matrix, w, &policies, timing, common, profile, python);
                self.matrix.save_json(&self.dir)?;
            }
        }
        bar.finish_and_clear();
        Ok(())
    }

    /// One configuration, unless the folder has it (and its baseline) already; then its PyTorch
    /// baseline where asked; saved. Returns whether the configuration ran.
    fn one(
        &mut self,
        w: &Workload,
        policy: &PolicyRequest,
        python: Option<&str>,
        bar: &ProgressBar,
    ) -> Result<bool> {
        let (args, common, profile) = (self.args, &self.args.common, self.profile);
        let have = self.matrix.find(&w.model, &policy.to_string()).is_some();
        let have_baseline = python.is_none()
            || !baseline::MODELS.contains(&w.model.as_str())
            || self.matrix.find_baseline(&w.model, &policy.to_string()).is_some();
        if !args.force && have && have_baseline {
            return Ok(false);
        }
        if !self.ran_any {
            // The files describe the run that produced their records: a resume that runs
            // nothing keeps the earlier command and commit.
            self.matrix.meta = meta(profile, &common.device);
            self.ran_any = true;
        }
        let mut ran = false;
        if args.force || !have {
            bar.set_message(format!("{} {policy}", w.model));
            // The bar is drawn on a terminal only: elsewhere a line says what is running (a
            // full-size profile takes minutes).
            if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
                trainkit::say!("measuring {} {policy}", w.model);
            }
            let rec = if profile.asks_24gb() {
                let execution = if args.dry_run { Execution::DryRun } else { Execution::Measure };
                fits_24gb::run_predicted(&mut self.matrix, w, policy, common, profile, execution)?
            } else {
                Some(spawn_one(
                    w,
                    policy,
                    common,
                    (profile, Some(&self.dir.join("profiles"))),
                    One::Full,
                ))
            };
            let Some(mut rec) = rec else { return Ok(false) };
            bar.suspend(|| trainkit::say!("{}", summary(&rec, self.matrix.find(&w.model, "off"))));
            self.statuses.push((format!("{} {policy}", w.model), rec.status));
            rec.command = this_command();
            rec.commit = self.matrix.meta.git_commit.clone();
            self.matrix.put(rec);
            ran = true;
        }
        if let Some(python) = python {
            self.baseline_beside(w, policy, python, bar);
        }
        self.matrix.save_json(&self.dir)?;
        Ok(ran)
    }

    /// `model`'s step through torch.compile at each of [`baseline::COMPILE_BUDGETS`], on the
    /// configuration of its `off` (where that ran), each budget unless the folder has it; saved.
    fn compile_sweep(&mut self, w: &Workload, python: &str, bar: &ProgressBar) -> Result<()> {
        let common = &self.args.common;
        let ours = match self.matrix.find(&w.model, "off") {
            Some(r) if r.status == Status::Ok && baseline::MODELS.contains(&w.model.as_str()) => {
                r.clone()
            }
            _ => return Ok(()),
        };
        for budget in baseline::COMPILE_BUDGETS {
            let policy = baseline::compiled_policy(budget);
            if !self.args.force && self.matrix.find_compiled(&w.model, &policy).is_some() {
                continue;
            }
            bar.set_message(format!("{} compiled, {policy}", w.model));
            if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
                trainkit::say!("compiling {} in PyTorch, {policy}", w.model);
            }
            let measure = Measure::Compiled(budget);
            let b = Baseline {
                command: this_command(),
                commit: self.matrix.meta.git_commit.clone(),
                ..baseline::run(
                    python,
                    &ours,
                    w.input_size,
                    common.steps,
                    common.seed,
                    measure,
                    None,
                )
            };
            bar.suspend(|| trainkit::say!("{}", compiled_summary(&b, &ours)));
            self.matrix.put_compiled(b);
            self.matrix.save_json(&self.dir)?;
        }
        Ok(())
    }

    /// PyTorch beside ours, where ours ran, and where ours was predicted not to fit this machine:
    /// there within what the machine can give (the same room ours was refused), to see whether
    /// it fits.
    fn baseline_beside(
        &mut self,
        w: &Workload,
        policy: &PolicyRequest,
        python: &str,
        bar: &ProgressBar,
    ) {
        let common = &self.args.common;
        let ours = self.matrix.find(&w.model, &policy.to_string());
        let limit = match ours {
            Some(r) if r.status == Status::Ok => Some(None),
            Some(r)
                if r.status == Status::Skipped
                    && r.error.starts_with(measure::one::STEP_DOES_NOT_FIT)
                    && !r.segment_ranges.is_empty() =>
            {
                Some(trainkit::free_memory(&candle_core::Device::Cpu).map(|free| free - free / 10))
            }
            _ => None,
        };
        if let (Some(ours), Some(limit)) = (ours, limit) {
            if baseline::MODELS.contains(&w.model.as_str()) {
                bar.set_message(format!("{} {policy} in PyTorch", w.model));
                let b = Baseline {
                    command: this_command(),
                    commit: self.matrix.meta.git_commit.clone(),
                    ..baseline::run(
                        python,
                        ours,
                        w.input_size,
                        common.steps,
                        common.seed,
                        Measure::Full,
                        limit,
                    )
                };
                bar.suspend(|| trainkit::say!("{}", baseline_summary(&b, ours)));
                self.matrix.put_baseline(b);
            }
        }
    }
}

/// What in the results folder was measured under another configuration than this run's
/// (profile, processor against `machine`, or a model's batch, input, device, threads or timed
/// steps): a description of each, empty if all match. Records are matched by model and policy,
/// so mixing them would compare unlike runs.
fn other_configurations(
    matrix: &Matrix,
    workloads: &[Workload],
    common: &Common,
    profile: Profile,
    machine: &str,
) -> Vec<String> {
    let mut out = Vec::new();
    if !matrix.records.is_empty() && matrix.meta.profile != profile.name() {
        out.push(format!("profile `{}`, this run `{profile}`", matrix.meta.profile));
    }
    // Another processor (a fresh clone's committed folder): one table would mix two machines.
    if !matrix.records.is_empty() && !same_processor(&matrix.meta.machine, machine) {
        out.push(format!("measured on {}, this machine {machine}", matrix.meta.machine));
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
        if r.device != common.device.to_string() {
            diff.push(format!("device {} vs {}", r.device, common.device));
        }
        let path = if common.fused_path == crate::cli::FusedPath::Generic { "generic" } else { "" };
        if r.status == Status::Ok && r.fused_path != path {
            diff.push(format!("fused path {:?} vs {path:?}", r.fused_path));
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

/// A compiled run's line: its peak and time against our `off`'s, and what compiling took.
fn compiled_summary(b: &Baseline, off: &Record) -> String {
    if b.status != Status::Ok {
        return format!("  {} compiled, {}: {}: {}", b.model, b.policy, b.status, b.error);
    }
    format!(
        "  {} compiled, {}: step peak {}, {:.0} ms a step (ours off {}, {:.0} ms), compiled in \
         {:.0} s",
        b.model,
        b.policy,
        mib(b.step_peak_bytes),
        b.step_ms_median,
        mib(off.step_peak_bytes),
        off.step_ms_median,
        b.compile_ms.unwrap_or(0.0) / 1e3
    )
}

/// A baseline's line: PyTorch's peak and time, and ours over them.
fn baseline_summary(b: &Baseline, ours: &Record) -> String {
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

/// A configuration's line: its peak (and the prediction), activations, time, against `off`, and the
/// gradient check.
fn summary(r: &Record, off: Option<&Record>) -> String {
    if r.status != Status::Ok {
        return format!("{:<14} {:<18} {}: {}", r.model, r.policy, r.status, r.error);
    }
    let vs_off = off
        .filter(|o| r.policy != "off" && o.status == Status::Ok && o.step_peak_bytes > 0)
        .map(|o| {
            format!(
                " ({:.2}x off peak, {:.2}x off time)",
                r.step_peak_bytes as f64 / o.step_peak_bytes as f64,
                r.step_ms_median / o.step_ms_median
            )
        })
        .unwrap_or_default();
    let grads = match (r.grads_checked, r.grads_bit_identical) {
        (false, _) if !r.check_skipped.is_empty() => {
            format!("grads not checked: {}", r.check_skipped)
        }
        (false, _) => "grads not checked".into(),
        (true, true) => "grads = plain candle bit for bit".into(),
        (true, false) => "GRADS DIFFER FROM PLAIN CANDLE".into(),
    };
    let predicted = r
        .predicted_peak_bytes
        .map(|p| {
            format!(
                " (predicted {}, {:+.1}%)",
                mib(p),
                (p as f64 / r.step_peak_bytes.max(1) as f64 - 1.0) * 100.0
            )
        })
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

/// The workloads `--models` names (all of them without it): a model's whole name selects it alone
/// (`gpt2-small`, not `gpt2-small-lora` too); another name selects the models it starts (`gpt2`,
/// or `gpt2-xl` for its variants `gpt2-xl/...`).
fn by_name(workloads: Vec<Workload>, models: &[String]) -> Vec<Workload> {
    let whole: Vec<bool> = models.iter().map(|m| workloads.iter().any(|w| w.model == *m)).collect();
    let named = |w: &Workload| {
        models.iter().zip(&whole).any(|(m, &whole)| {
            if whole {
                w.model == *m
            } else {
                w.model.starts_with(m.as_str())
            }
        })
    };
    workloads.into_iter().filter(|w| models.is_empty() || named(w)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--models`: a whole name alone, a prefix its family.
    #[test]
    fn models_are_selected_by_whole_name_or_prefix() {
        let names = |models: &[&str]| -> Vec<String> {
            let models: Vec<String> = models.iter().map(|m| m.to_string()).collect();
            let all = workloads::profile(Profile::Cpu)
                .into_iter()
                .chain(workloads::profile(Profile::Gpt2_24gb));
            by_name(all.collect(), &models).into_iter().map(|w| w.model).collect()
        };
        assert_eq!(names(&["gpt2-small", "bert-large"]), ["bert-large", "gpt2-small"]);
        assert_eq!(names(&["gpt2-small-lora"]), ["gpt2-small-lora"]);
        assert_eq!(names(&["bert"]), ["bert-large", "bert-large-lora"]);
        assert_eq!(names(&["gpt2-xl"]).len(), workloads::STATE_VARIANTS.len());
    }
}
