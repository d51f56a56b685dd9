//! The article's A100 table projected at its own sizes by the planner, for machines that cannot
//! run them: each model of the `full` profile is built, its stages profiled one at a time at the
//! full input size, at the article's batch where it is at most [`PROBES`]`.1`, else at the two
//! probe batches and extrapolated to the article's batch; the state
//! (parameters, optimizer, inputs) is arithmetic. Every policy and two planner plans are then
//! predicted. These are predictions, labelled so; where a GPU run exists, its measured figures
//! sit beside them in `TABLE.md`.

use crate::child::{child_error, die_with_parent, this_command};
use crate::cli::Common;
use crate::record::{ProjectedPolicy, Projection};
use crate::results::{made_by, Matrix};
use crate::workloads::{self, Workload};
use anyhow::{bail, Context, Result};
use candle_core::Device;
use layers::TrainOptimizer;
use remat::memory::tensor_bytes;
use remat::plan::{Estimate, Profile};
use remat::Policy;
use std::process::Command;

/// The batches a projection measures at and extrapolates from, when the article's is larger.
pub const PROBES: (usize, usize) = (8, 16);

/// The `full` profile's models that stand for rows of the article's table.
pub const MODELS: [&str; 4] = ["resnet50", "resnet152", "bert-large", "unet3d-cicek"];

/// `project-one`: one model of the `full` profile projected at its size, printed as JSON.
pub fn project_one(model: &str, common: &Common) -> Result<()> {
    let dev = common.device.open()?;
    let w = workloads::profile(workloads::Profile::Full)
        .into_iter()
        .find(|w| w.model == model)
        .with_context(|| format!("model `{model}` is not in profile `full`"))?;
    println!("{}", serde_json::to_string(&project(&w, &dev, common.seed)?)?);
    Ok(())
}

/// Runs `project-one` for every model of the article's table that `models` selects (all where
/// it is empty), in fresh processes, into the matrix; a projection already there is kept unless
/// `force`.
pub fn project_all(matrix: &mut Matrix, models: &[String], common: &Common, force: bool) {
    for model in MODELS.iter().filter(|m| models.is_empty() || models.iter().any(|s| m.starts_with(s.as_str()))) {
        if !force && matrix.projections.iter().any(|p| p.model == *model) {
            continue;
        }
        let exe = std::env::current_exe().expect("own executable");
        let mut cmd = Command::new(exe);
        cmd.args(["project-one", "--model", model, "--seed", &common.seed.to_string(), "--device", &common.device.to_string()]);
        die_with_parent(&mut cmd);
        let projected = cmd.output().map_err(anyhow::Error::from).and_then(|out| {
            let stdout = String::from_utf8_lossy(&out.stdout);
            match stdout.lines().last().and_then(|l| serde_json::from_str::<Projection>(l).ok()) {
                Some(p) if out.status.success() => Ok(p),
                _ => bail!("{}", child_error(&String::from_utf8_lossy(&out.stderr), out.status)),
            }
        });
        match projected {
            Ok(p) => {
                let p = Projection { command: this_command(), ..p };
                let off = p.rows.first().map_or(0, |r| r.total_bytes);
                trainkit::say!("projected {model} at batch {} ({}): off {:.1} GB", p.batch, p.input, off as f64 / 1e9);
                matrix.put_projection(p);
            }
            Err(e) => trainkit::say!("projection of {model} failed: {e:#}"),
        }
    }
}

/// Profiles `w` (its `full` size) and predicts its policies, the plan with the least recompute
/// that fits `sqrt`'s memory, and the plan with the least memory.
pub fn project(w: &Workload, device: &Device, seed: u64) -> Result<Projection> {
    let inst = w.build(device, seed)?;
    let store = inst.store();
    let weights: u64 =
        store.vars().iter().map(|v| tensor_bytes(v.as_tensor())).sum::<u64>() + store.buffers().map(|(_, b)| tensor_bytes(b.as_tensor())).sum::<u64>();
    let one = trainkit::Group::single();
    let optimizer: Box<dyn TrainOptimizer> = inst.optimizer(false, &one)?;
    let inputs = inst.inputs_at(0, 1)?.iter().map(tensor_bytes).sum::<u64>() * w.batch as u64;
    let state_bytes = weights + optimizer.state_bytes() + inputs;
    drop(optimizer);
    let inputs_at = |n| inst.inputs_at(0, n);
    let vars = inst.store().vars();
    let profile = if w.batch <= PROBES.1 {
        Profile::at_batch(inst.graph(), inputs_at, &vars, w.batch, seed)?
    } else {
        Profile::extrapolated(inst.graph(), inputs_at, &vars, PROBES, w.batch, seed)?
    };
    let row = |label: String, plan: String, e: &Estimate| ProjectedPolicy {
        label,
        plan,
        peak_bytes: e.peak,
        total_bytes: state_bytes + e.peak,
        time_ratio: e.time_ratio(),
    };
    let mut rows = Vec::new();
    for policy in w.policies() {
        rows.push(row(policy.to_string(), String::new(), &profile.predict_policy(&policy, 0)?));
    }
    let sqrt_total = state_bytes + profile.predict_policy(&Policy::Sqrt, 0)?.peak;
    let at_sqrt = profile.plan(sqrt_total, state_bytes, 0)?;
    rows.push(row("budget = sqrt's memory".into(), at_sqrt.policy().to_string(), &at_sqrt.estimate));
    let least = profile.least_peak(0);
    rows.push(row("least memory".into(), least.policy().to_string(), &least.estimate));
    Ok(Projection {
        model: w.model.clone(),
        batch: w.batch,
        input: w.input(),
        optimizer: w.optimizer().to_string(),
        dtype: w.dtype.to_string(),
        state_bytes,
        rows,
        command: String::new(), // the matrix run that asked for it names itself
    })
}

fn gb(bytes: u64) -> String {
    format!("{:.1} GB", bytes as f64 / 1e9)
}

/// The `TABLE.md` section: every projection beside the article's figures (`article(model)`:
/// off GB, checkpointed GB, time increase).
pub fn render(projections: &[Projection], last_run: &str, article: impl Fn(&str) -> Option<(f64, f64, &'static str)>) -> String {
    if projections.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "\n## Projected at the article's sizes (predictions, not measurements)\n\n{}.\n\n\
         The planner's prediction for the article's configurations, which do not fit this machine: each model built at its full \
         size, its stages profiled one at a time at the full input size, at the article's batch where it is 16 or less, else at \
         batches 8 and 16 and extrapolated (kept bytes are linear in the batch; some kernels' temporaries grow slower, so those \
         projections lean high); the state (weights, optimizer state, inputs) is arithmetic. Totals \
         are the state plus the step's predicted peak, in GB (10^9 bytes, as the article writes them). Time is the predicted step \
         time over `off`'s from this machine's stage times (a CPU ratio, not an A100's). *budget = sqrt's memory*: the plan with \
         the least recompute whose peak fits what `sqrt` needs; *least memory*: the plan with the smallest peak. The article's \
         optimizer is not stated: each model trains with its benchmark default (the `optimizer` column: SGD with momentum for \
         the ResNets, AdamW for BERT and the U-Net).\n\n\
         | model | batch | input | optimizer | state | policy or plan | predicted total | / off | predicted time | article: off → checkpointing | article: time |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
        made_by(projections.iter().map(|p| p.command.as_str()), last_run)
    );
    for p in projections {
        let off = p.rows.iter().find(|r| r.label == "off").map_or(1, |r| r.total_bytes);
        let art = article(&p.model).map_or("-".to_string(), |(o, c, _)| format!("{o} GB → {c} GB ({:.2})", c / o));
        let art_time = article(&p.model).map_or("-", |(_, _, t)| t);
        for (k, r) in p.rows.iter().enumerate() {
            let policy = if r.plan.is_empty() { format!("`{}`", r.label) } else { format!("{} (`{}`)", r.label, r.plan) };
            let (model, batch, input, optimizer, state, a, at) = if k == 0 {
                (p.model.as_str(), p.batch.to_string(), p.input.as_str(), p.optimizer.as_str(), gb(p.state_bytes), art.as_str(), art_time)
            } else {
                ("", String::new(), "", "", String::new(), "", "")
            };
            out += &format!(
                "| {model} | {batch} | {input} | {optimizer} | {state} | {policy} | {} | {:.2} | {:+.0}% | {a} | {at} |\n",
                gb(r.total_bytes),
                r.total_bytes as f64 / off as f64,
                (r.time_ratio - 1.0) * 100.0
            );
        }
    }
    out
}
