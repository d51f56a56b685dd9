//! `--baseline pytorch`: the same configurations in PyTorch eager (`scripts/torch_baseline.py`),
//! one fresh Python process per configuration, cut into the same checkpoint segments as ours.

use crate::measure::{Record, Status};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::process::Command;

/// The models `scripts/torch_baseline.py` has a PyTorch version of.
pub const MODELS: [&str; 5] = ["resnet50", "resnet152", "bert-large", "unet3d-small", "gpt2-small"];

/// One PyTorch row, as the script prints it (plus status and error where it failed).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Baseline {
    /// The harness command that ran it (with `--baseline pytorch`).
    #[serde(default)]
    pub command: String,
    pub framework: String,
    #[serde(default)]
    pub framework_version: String,
    pub model: String,
    pub policy: String,
    pub batch: usize,
    pub threads: usize,
    pub segments: usize,
    pub model_state_bytes: u64,
    pub step_peak_bytes: u64,
    pub fwd_bwd_peak_bytes: u64,
    pub step_ms_median: f64,
    pub step_ms_min: f64,
    pub step_ms_max: f64,
    pub timed_steps: usize,
    pub loss: f64,
    #[serde(default = "ok")]
    pub status: Status,
    #[serde(default)]
    pub error: String,
}

fn ok() -> Status {
    Status::Ok
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/torch_baseline.py")
}

/// Whether `python` can import torch, torchvision and transformers; if not, why, with how to
/// install them.
pub fn available(python: &str) -> Result<(), String> {
    let probe = Command::new(python).args(["-c", "import torch, torchvision, transformers"]).output();
    match probe {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(format!(
            "`{python}` cannot import torch, torchvision and transformers ({}); install them with \
             `python3 -m venv .venv && .venv/bin/pip install torch torchvision transformers` and pass `--python .venv/bin/python`",
            String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("").trim()
        )),
        Err(e) => Err(format!("cannot run `{python}`: {e}; pass --python with a Python that has torch")),
    }
}

/// Runs the PyTorch version of `ours` (same model, batch, input size, segments, steps, threads).
pub fn run(python: &str, ours: &Record, input_size: usize, steps: usize, seed: u64) -> Baseline {
    let failed = |error: String| Baseline {
        framework: "pytorch".into(),
        model: ours.model.clone(),
        policy: ours.policy.clone(),
        batch: ours.batch,
        status: Status::Error,
        error,
        ..Default::default()
    };
    let segments: Vec<String> = ours.segment_ranges.iter().map(|[a, b]| format!("{a}:{b}")).collect();
    if segments.is_empty() {
        return failed("our run recorded no segments".into());
    }
    let mut cmd = Command::new(python);
    crate::die_with_parent(&mut cmd);
    let out = cmd
        .arg(script())
        .args(["--model", &ours.model, "--policy", &ours.policy, "--segments", &segments.join(",")])
        .args(["--batch", &ours.batch.to_string(), "--input-size", &input_size.to_string()])
        .args(["--steps", &steps.to_string(), "--threads", &ours.threads.to_string(), "--seed", &seed.to_string()])
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
            let last = stderr.lines().rev().find(|l| !l.trim().is_empty() && !l.contains("USDT") && !l.starts_with("ERROR:")).unwrap_or("");
            failed(format!("{} ({})", last.trim(), out.status))
        }
    }
}
