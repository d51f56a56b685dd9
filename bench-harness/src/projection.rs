//! The article's A100 table projected at its own sizes by the planner, before (or instead of)
//! running it: each model of the `full` profile is built, its stages profiled one at a time at the
//! full input size, at the article's batch where it is at most [`PROBES`]`.1`, else at the two
//! probe batches and extrapolated to the article's batch; the state (parameters, optimizer,
//! inputs) is arithmetic. Every policy and three planner plans are then predicted. These are
//! predictions, labelled so; where the folder measured the same configuration (`--profile full`),
//! the measurement and the projection's error sit beside them in `TABLE.md`. `gpt2-24gb` predicts
//! its configurations the same way ([`spawn_projection`]).

use crate::child::{child_error, die_with_parent, pass_overrides, this_command};
use crate::cli::Common;
use crate::measure::predict;
use crate::record::{ProjectedPolicy, Projection};
use crate::results::{made_by, Matrix};
use crate::workloads::{self, Overrides, Workload};
use anyhow::{bail, Context, Result};
use candle_core::Device;
use remat::memory::tensor_bytes;
use remat::plan::{Estimate, Grads, Profile};
use remat::{Policy, PolicyRequest};
use std::process::Command;

/// The batches a projection measures at and extrapolates from, when the article's is larger.
pub const PROBES: (usize, usize) = (8, 16);

/// The `full` profile's models that stand for rows of the article's table.
pub const MODELS: [&str; 4] = ["resnet50", "resnet152", "bert-large", "unet3d-cicek"];

/// `project-one`: one model of a profile (`full` unless `--profile` says otherwise, with the
/// command line's overrides) projected at its size, printed as JSON.
pub fn project_one(model: &str, common: &Common) -> Result<()> {
    let dev = common.device.open()?;
    let profile = common.profile.unwrap_or(workloads::Profile::Full);
    let w = workloads::profile(profile)
        .into_iter()
        .find(|w| w.model == model)
        .with_context(|| format!("model `{model}` is not in profile `{profile}`"))?
        .overridden(common.overrides());
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
        // At the article's sizes: the command line's sizes are this run's, not the article's.
        match spawn_projection(model, workloads::Profile::Full, common, Overrides::default()) {
            Ok(p) => {
                let off = p.rows.first().map_or(0, |r| r.total_bytes);
                trainkit::say!("projected {model} at batch {} ({}): off {:.1} GB", p.batch, p.input, off as f64 / 1e9);
                matrix.put_projection(p);
            }
            Err(e) => trainkit::say!("projection of {model} failed: {e:#}"),
        }
    }
}

/// `project-one` of `model` of `profile` in a fresh process (a projection builds the model at its
/// size: its memory must not stay in this one), with the changes `overrides` makes to it.
pub fn spawn_projection(model: &str, profile: workloads::Profile, common: &Common, overrides: Overrides) -> Result<Projection> {
    let exe = std::env::current_exe().expect("own executable");
    let mut cmd = Command::new(exe);
    cmd.args(["project-one", "--model", model, "--profile", profile.name(), "--seed", &common.seed.to_string(), "--device", &common.device.to_string()]);
    pass_overrides(&mut cmd, overrides);
    die_with_parent(&mut cmd);
    let out = cmd.output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout.lines().last().and_then(|l| serde_json::from_str::<Projection>(l).ok()) {
        Some(p) if out.status.success() => Ok(Projection { command: this_command(), ..p }),
        _ => bail!("{}", child_error(&String::from_utf8_lossy(&out.stderr), out.status)),
    }
}

/// The budget every projection also plans for: the 24 GB card of the article's GPT-2 claim.
pub const CARD_BUDGET: u64 = 24 << 30;

/// Profiles `w` (at its size) and predicts its policies (with its gradient accumulation), the
/// plan with the least recompute that fits `sqrt`'s memory, the plan for a 24 GiB card, and the
/// plan with the least memory. The state is the weights as built plus the optimizer state and
/// one batch of inputs by arithmetic: the optimizer is never built (GPT-2 XL's AdamW moments
/// alone are 12.5 GB), so a model projects wherever its weights and one stage fit.
pub fn project(w: &Workload, device: &Device, seed: u64) -> Result<Projection> {
    let inst = w.build(device, seed)?;
    let store = inst.store();
    let weights: u64 =
        store.vars().iter().map(|v| tensor_bytes(v.as_tensor())).sum::<u64>() + store.buffers().map(|(_, b)| tensor_bytes(b.as_tensor())).sum::<u64>();
    let shapes: Vec<Vec<usize>> = store.vars().iter().map(|v| v.dims().to_vec()).collect();
    let (_, _, optimizer) = w.state(&shapes);
    let inputs = inst.inputs_at(0, 1)?.iter().map(tensor_bytes).sum::<u64>() * w.batch as u64;
    let state_bytes = weights + optimizer + inputs;
    let inputs_at = |n| inst.inputs_at(0, n);
    let vars = inst.store().vars();
    let profile = if w.batch <= PROBES.1 {
        Profile::at_batch(inst.graph(), inputs_at, &vars, w.batch, seed)?
    } else {
        Profile::extrapolated(inst.graph(), inputs_at, &vars, PROBES, w.batch, seed)?
    };
    // Accumulating, every micro-batch after the first holds all parameter gradients.
    let grads = Grads::of(&profile, w.accumulate, w.in_backward);
    let row = |label: String, plan: String, e: &Estimate| ProjectedPolicy {
        label,
        plan,
        peak_bytes: e.peak,
        total_bytes: state_bytes + e.peak,
        time_ratio: e.time_ratio(),
    };
    let mut rows = Vec::new();
    for policy in w.policies() {
        rows.push(row(policy.to_string(), String::new(), &predict(&profile, &policy, w)?));
    }
    let sqrt_total = state_bytes + predict(&profile, &Policy::Sqrt, w)?.peak;
    let at_sqrt = profile.plan(sqrt_total, state_bytes, grads)?;
    rows.push(row("budget = sqrt's memory".into(), at_sqrt.policy().to_string(), &at_sqrt.estimate));
    // A card the model does not fit at any plan has no row for it.
    if let Ok(card) = profile.plan(CARD_BUDGET, state_bytes, grads) {
        rows.push(row(PolicyRequest::Budget(CARD_BUDGET).to_string(), card.policy().to_string(), &card.estimate));
    }
    let least = profile.least_peak(grads);
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

/// The `TABLE.md` section: every projection of `m` beside the article's figures (`article(model)`:
/// off GB, checkpointed GB, time increase) and, where `m` measured the same model, batch, input
/// and policy, beside the measurement, with the projection's error.
pub fn render(m: &Matrix, article: impl Fn(&str) -> Option<(f64, f64, &'static str)>) -> String {
    let projections = &m.projections;
    if projections.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "\n## Projected at the article's sizes (predictions, beside measurements where they ran)\n\n{}.\n\n\
         The planner's prediction for the article's configurations: each model built at its full \
         size, its stages profiled one at a time at the full input size, at the article's batch where it is 16 or less, else at \
         batches 8 and 16 and extrapolated (kept bytes are linear in the batch; some kernels' temporaries grow slower, so those \
         projections lean high); the state (weights, optimizer state, inputs) is arithmetic. Totals \
         are the state plus the step's predicted peak, in GB (10^9 bytes, as the article writes them). Time is the predicted step \
         time over `off`'s from this machine's stage times (a CPU ratio, not an A100's). *budget = sqrt's memory*: the plan with \
         the least recompute whose peak fits what `sqrt` needs; *budget=24GiB*: the plan with the least recompute for a 24 GiB \
         card; *least memory*: the plan with the smallest peak. *Measured*: the same configuration run in this folder \
         (state plus step peak), and the projection's error against it. The article's \
         optimizer is not stated: each model trains with its benchmark default (the `optimizer` column: SGD with momentum for \
         the ResNets, AdamW for BERT and the U-Net).\n\n\
         | model | batch | input | optimizer | state | policy or plan | predicted total | / off | predicted time | measured | error | article: off → checkpointing | article: time |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        made_by(projections.iter().map(|p| p.command.as_str()), &m.meta.command)
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
            let measured = m
                .find(&p.model, &r.label)
                .filter(|rec| rec.status == crate::record::Status::Ok && rec.batch == p.batch && rec.input == p.input)
                .map(|rec| rec.model_state_bytes + rec.step_peak_bytes);
            let (measured, error) = measured.map_or(("-".into(), "-".into()), |b| (gb(b), format!("{:+.1}%", (r.total_bytes as f64 / b as f64 - 1.0) * 100.0)));
            out += &format!(
                "| {model} | {batch} | {input} | {optimizer} | {state} | {policy} | {} | {:.2} | {:+.0}% | {measured} | {error} | {a} | {at} |\n",
                gb(r.total_bytes),
                r.total_bytes as f64 / off as f64,
                (r.time_ratio - 1.0) * 100.0
            );
        }
    }
    out
}
