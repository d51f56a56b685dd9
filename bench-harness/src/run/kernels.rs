//! `bench-harness kernels`: every convolution the `cpu` profile's models run, recorded from
//! their forward passes, timed here and in PyTorch (`scripts/torch_ops.py --convs`) on the same
//! shapes, in interleaved rounds (ours, then PyTorch's, per round), into `convs.{json,md}`.
//!
//! The experiment's other layers: [`crate::measure::kernels`] (the recording and the timing, in
//! this process) and [`crate::report::kernels`] (the report and its files).

use crate::measure::kernels;
use crate::report::kernels::{ConvTimes, Entry, KernelReport};
use crate::report::record::Spread;
use crate::workloads::{self, Profile};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(clap::Args)]
pub struct KernelArgs {
    /// The models whose convolutions are timed (of the `cpu` profile); default: every one that
    /// has convolutions.
    #[arg(long, value_delimiter = ',')]
    pub models: Vec<String>,
    /// Interleaved rounds, ours then PyTorch's in each; each side's figure is the median of
    /// its rounds.
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Timed repetitions of each part of each convolution per round (after two warm-ups).
    #[arg(long, default_value_t = 9)]
    pub reps: usize,
    /// The Python that has torch; where it has not, ours alone are timed.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Where `convs.json` and `convs.md` go.
    #[arg(long, default_value = "results/convs-cpu")]
    pub out: PathBuf,
}

pub fn run(args: &KernelArgs) -> Result<()> {
    if args.rounds == 0 || args.reps == 0 {
        bail!("--rounds and --reps must be at least 1");
    }
    let device = candle_core::Device::Cpu;
    let mut report = record(&args.models, &device)?;
    let torch = torch_available(&args.python);
    if let Err(why) = &torch {
        trainkit::say!("no PyTorch beside ours: {why}");
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let list = args.out.join("convs.list.json");
    crate::report::write_file(&list, serde_json::to_string_pretty(&calls_json(&report))?)?;
    let (mut ours, mut theirs) = (vec![Vec::new(); report.entries.len()], Vec::new());
    for round in 1..=args.rounds {
        for (i, e) in report.entries.iter().enumerate() {
            trainkit::say!("round {round}/{}: ours {}/{}: {}", args.rounds, i + 1, ours.len(), e);
            ours[i].push(kernels::time(&e.call, &device, args.reps)?);
        }
        if torch.is_ok() {
            trainkit::say!(
                "round {round}/{}: PyTorch, the same {} convolutions",
                args.rounds,
                ours.len()
            );
            theirs.push(torch_times(&args.python, &list, args.reps, report.entries.len())?);
        }
    }
    std::fs::remove_file(&list).ok();
    for (i, e) in report.entries.iter_mut().enumerate() {
        e.ours = Some(median(&ours[i]));
        e.torch =
            (!theirs.is_empty()).then(|| median(&theirs.iter().map(|r| r[i]).collect::<Vec<_>>()));
    }
    report.torch = torch.ok();
    report.save(&args.out)?;
    trainkit::say!("results in {}", args.out.display());
    Ok(())
}

/// The convolutions of the `cpu` profile's `models` (all where none is named), recorded from a
/// forward pass of each.
fn record(models: &[String], device: &candle_core::Device) -> Result<KernelReport> {
    let profile = workloads::profile(Profile::Cpu);
    if let Some(unknown) = models.iter().find(|m| profile.iter().all(|w| w.model != **m)) {
        let names: Vec<&str> = profile.iter().map(|w| w.model.as_str()).collect();
        bail!("--models: `{unknown}` is not a model of the cpu profile ({})", names.join(", "));
    }
    let mut report = KernelReport::new(crate::report::results::machine());
    for w in profile {
        if !models.is_empty() && !models.contains(&w.model) {
            continue;
        }
        trainkit::say!("recording the convolutions of {} ({} x {})", w.model, w.batch, w.input());
        for call in kernels::convolutions(&w, device, 0)? {
            report.add(&w.model, call);
        }
    }
    if report.entries.is_empty() {
        bail!("no convolution to time: the models chosen ({models:?}) run none");
    }
    Ok(report)
}

/// Each part's median over the rounds.
fn median(rounds: &[ConvTimes]) -> ConvTimes {
    let of = |f: &dyn Fn(&ConvTimes) -> Option<f64>| {
        Spread::of(rounds.iter().filter_map(f).collect()).map(|s| s.median)
    };
    ConvTimes {
        forward_ms: of(&|t| Some(t.forward_ms)).unwrap_or(f64::NAN),
        input_grad_ms: of(&|t| t.input_grad_ms),
        weight_grad_ms: of(&|t| Some(t.weight_grad_ms)).unwrap_or(f64::NAN),
    }
}

/// The convolutions as `torch_ops.py --convs` reads them.
fn calls_json(report: &KernelReport) -> serde_json::Value {
    let calls = report.entries.iter().map(|e| {
        let (sd, shw, pd, phw) = e.call.geometry;
        serde_json::json!({
            "kind": e.call.kind.name(),
            "shapes": e.call.shapes,
            "geometry": [sd, shw, pd, phw],
            "input_gradient": e.call.needs_input_gradient(),
        })
    });
    serde_json::Value::Array(calls.collect())
}

/// PyTorch's version and thread count where `python` imports torch, else why not.
fn torch_available(python: &str) -> std::result::Result<String, String> {
    let probe = Command::new(python)
        .args([
            "-c",
            "import torch; print(torch.__version__, torch.backends.cpu.get_cpu_capability())",
        ])
        .output();
    match probe {
        Ok(out) if out.status.success() => {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        }
        Ok(out) => Err(format!(
            "`{python}` cannot import torch ({}); pass --python with one that can",
            String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("").trim()
        )),
        Err(e) => Err(format!("could not start `{python}`: {e}")),
    }
}

/// PyTorch's times of the `n` convolutions listed in `list`, one round.
fn torch_times(python: &str, list: &Path, reps: usize, n: usize) -> Result<Vec<ConvTimes>> {
    let mut cmd = Command::new(python);
    super::child::die_with_parent(&mut cmd);
    let threads = candle_core::utils::get_num_threads().to_string();
    let out = cmd
        .arg(super::baseline::script("torch_ops.py"))
        .args(["--threads", &threads, "--reps", &reps.to_string(), "--convs"])
        .arg(list)
        .output()
        .with_context(|| format!("starting {python}"))?;
    if !out.status.success() {
        bail!(
            "scripts/torch_ops.py failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
        );
    }
    let times: Vec<ConvTimes> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(serde_json::from_str)
        .collect::<std::result::Result<_, _>>()
        .context("reading scripts/torch_ops.py's times")?;
    if times.len() != n {
        bail!("scripts/torch_ops.py timed {} convolutions of {n}", times.len());
    }
    Ok(times)
}

impl std::fmt::Display for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {:?} with {:?}",
            self.call.kind.name(),
            self.call.shapes[0],
            self.call.shapes[self.call.data_operands()]
        )
    }
}
