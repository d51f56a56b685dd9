//! `--baseline pytorch`: the same configurations in PyTorch eager (`scripts/torch_baseline.py`),
//! one fresh Python process per configuration, cut into the same checkpoint segments as ours.
//!
//! The experiment's other layers: [`super::matrix`] runs it beside ours and in the timing rounds;
//! no `measure` module (the script measures PyTorch); [`crate::report::baseline`] shows it beside
//! ours, and [`crate::report::record::Baseline`] is its row.

use crate::report::record::{Baseline, Record, Status};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The models `scripts/torch_baseline.py` has a PyTorch version of.
pub const MODELS: [&str; 10] = [
    "resnet50",
    "resnet152",
    "bert-large",
    "unet3d-small",
    "unet3d-cicek",
    "gpt2-small",
    "bert-large-lora",
    "gpt2-small-lora",
    "smollm2-135m",
    "smollm2-135m-lora",
];

/// The script `name` of `scripts/` in the repository the harness runs in (a binary built
/// elsewhere and shipped to a GPU machine runs there from the repository's root), else where
/// the harness was built.
pub fn script(name: &str) -> PathBuf {
    let here = Path::new("scripts").join(name);
    if here.exists() {
        return here;
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts").join(name)
}

/// Whether `python` can import torch, torchvision and transformers; if not, why, with how to
/// install them.
pub fn available(python: &str) -> Result<(), String> {
    let probe =
        Command::new(python).args(["-c", "import torch, torchvision, transformers"]).output();
    match probe {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(format!(
            "`{python}` cannot import torch, torchvision and transformers ({}); install them with \
             `python3 -m venv .venv && .venv/bin/pip install torch torchvision transformers peft` \
             and pass `--python .venv/bin/python`",
            String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("").trim()
        )),
        Err(e) => {
            Err(format!("cannot run `{python}`: {e}; pass --python with a Python that has torch"))
        }
    }
}

/// What a PyTorch run measures, as ours does in `measure::One::Full` and `One::TimeOnly`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Measure {
    /// Memory and time (the run beside ours).
    Full,
    /// Its steps timed, no memory measured (a timing round: `--time-only`).
    TimeOnly,
    /// Memory and time of the whole step through torch.compile, its backward keeping this share
    /// of the activations (`activation_memory_budget`), and the time compiling took.
    Compiled(f64),
    /// The steps of [`Measure::Compiled`] timed only (a timing round).
    CompiledTimeOnly(f64),
}

/// The activation memory budgets of `--baseline pytorch-compile`'s sweep, per model: inductor's
/// memory/time curve from keeping what its partitioner would (1.0) to recomputing most (0.1).
pub const COMPILE_BUDGETS: [f64; 5] = [1.0, 0.7, 0.4, 0.2, 0.1];

/// The policy name a compiled run is recorded under.
pub fn compiled_policy(budget: f64) -> String {
    format!("memory-budget={budget}")
}

/// Runs the PyTorch version of `ours` (same model, batch, input size, segments, steps, threads,
/// device), measuring what `measure` says. `memory_limit`: the bytes it may allocate, beyond
/// which it ends as `oom` (where ours was predicted not to fit).
pub fn run(
    python: &str,
    ours: &Record,
    input_size: usize,
    steps: usize,
    seed: u64,
    measure: Measure,
    memory_limit: Option<u64>,
) -> Baseline {
    let (framework, policy) = match measure {
        Measure::Compiled(budget) | Measure::CompiledTimeOnly(budget) => {
            ("pytorch-compile", compiled_policy(budget))
        }
        Measure::Full | Measure::TimeOnly => ("pytorch", ours.policy.clone()),
    };
    let failed = |error: String| Baseline {
        framework: framework.into(),
        model: ours.model.clone(),
        policy: policy.clone(),
        batch: ours.batch,
        status: Status::Error,
        error,
        ..Default::default()
    };
    let segments: Vec<String> =
        ours.segment_ranges.iter().map(|[a, b]| format!("{a}:{b}")).collect();
    if segments.is_empty() {
        return failed("our run recorded no segments".into());
    }
    let mut cmd = Command::new(python);
    super::child::die_with_parent(&mut cmd);
    let out = cmd
        .arg(script("torch_baseline.py"))
        .args(["--model", &ours.model, "--policy", &policy, "--segments", &segments.join(",")])
        .args(["--batch", &ours.batch.to_string(), "--input-size", &input_size.to_string()])
        .args([
            "--steps",
            &steps.to_string(),
            "--threads",
            &ours.threads.to_string(),
            "--seed",
            &seed.to_string(),
            "--device",
            &ours.device,
        ])
        .args(
            matches!(measure, Measure::TimeOnly | Measure::CompiledTimeOnly(_))
                .then_some("--time-only"),
        )
        .args(match measure {
            Measure::Compiled(budget) | Measure::CompiledTimeOnly(budget) => {
                vec!["--compile".into(), format!("--memory-budget={budget}")]
            }
            Measure::Full | Measure::TimeOnly => Vec::new(),
        })
        .args(memory_limit.map(|b| format!("--memory-limit={b}")))
        .output();
    let out = match out {
        Ok(out) => out,
        Err(e) => return failed(format!("could not start {python}: {e}")),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout.lines().last().map(serde_json::from_str::<Baseline>) {
        Some(Ok(b)) if out.status.success() => b,
        _ => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let last = stderr
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty() && !l.contains("USDT") && !l.starts_with("ERROR:"))
                .unwrap_or("");
            let status =
                if last.starts_with("out of memory") { Status::Oom } else { Status::Error };
            Baseline { status, ..failed(format!("{} ({})", last.trim(), out.status)) }
        }
    }
}
