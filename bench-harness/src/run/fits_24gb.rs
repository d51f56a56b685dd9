//! `--matrix gpt2-24gb` and `--matrix llm-24gb`: does GPT-2 at every published size train in
//! 24 GiB with checkpointing and gradient accumulation (the article: GPT-2 1.5B in 21 GB)? And the
//! Llama-family models users fine-tune today, 0.5B to 8B, fully or with LoRA? Their defaults and
//! their prediction before a configuration runs.
//!
//! The prediction ([`predict`]) is the planner's at the configuration's own size: the model is
//! built in a fresh process and its stages profiled one at a time at batch 1 and the full
//! sequence (`measure::projection`; the blocks are alike, so one block is measured and its
//! figures reused for the others; a Llama-family model is built two blocks deep and its profile
//! deepened), so a configuration that cannot fit is never started.
//! The model state is exact arithmetic on the parameter shapes: the parameters and their
//! gradients in f32 whatever the activation dtype (they are the master weights), bf16 under
//! `bf16-weights`; and the optimizer's state, f32 in every variant: AdamW two moments per
//! parameter, Adafactor R + C numbers per R x C weight (a vector whole), SGD one buffer. Under
//! LoRA the base is held without gradients or optimizer state, the adapters with both. The rest
//! of the predicted peak (activations, temporaries, the inputs) is the planner's.
//!
//! The experiment's other layers: [`crate::workloads`] (its configurations: `gpt2_24gb` and
//! `STATE_VARIANTS`, `llm_24gb` and `LLM_VARIANTS`), [`crate::measure::projection`] (the
//! projection, started by [`super::projection::spawn_projection`]), [`crate::measure::one`] (each
//! configuration run, as in every matrix) and [`crate::report::fits_24gb`] (its table and figure).

use super::child::spawn_one;
use super::Execution;
use crate::cli::Common;
use crate::measure::One;
use crate::report::record::{Prediction, Projection, Record, Status};
use crate::report::results::Matrix;
use crate::report::units;
use crate::workloads::{Profile, Workload, CARD_BYTES};
use anyhow::{bail, Context, Result};
use remat::PolicyRequest;

/// `--matrix gpt2-24gb` or `llm-24gb`: its `profile`, and a memory cap of 24 GiB, or on the CPU
/// what this machine can give if that is less.
pub fn defaults(common: &mut Common, profile: Profile) -> Result<()> {
    if common.profile.is_some_and(|p| p != profile) {
        bail!("--matrix {profile} runs its own profile; drop --profile");
    }
    common.profile = Some(profile);
    // The harness, the OS and the page cache need some of what is available.
    let machine = trainkit::available_memory().map(|b| b.saturating_sub(3 << 30));
    let cpu = common.device == trainkit::DeviceName::Cpu;
    common.memory_cap = common.memory_cap.or(Some(if cpu {
        machine.map_or(CARD_BYTES, |m| m.min(CARD_BYTES))
    } else {
        CARD_BYTES
    }));
    Ok(())
}

/// A `gpt2-24gb` or `llm-24gb` configuration: predicted first ([`predict`], from the model's projection, made
/// once per model and kept in the matrix), skipped where the prediction exceeds the memory cap,
/// run otherwise. The gradient check needs two models and a copy of every gradient beside them,
/// so it runs only where that fits the cap (four times the parameters' f32 bytes, with room for
/// the activations). [`Execution::DryRun`]: predicted and recorded as not run.
pub fn run_predicted(
    matrix: &mut Matrix,
    w: &Workload,
    policy: &PolicyRequest,
    common: &Common,
    profile: Profile,
    execution: Execution,
) -> Result<Option<Record>> {
    if !matrix.projections.iter().any(|p| p.model == w.model) {
        let p = super::projection::spawn_projection(&w.model, profile, common, common.overrides())
            .with_context(|| format!("predicting {}", w.model))?;
        matrix.put_projection(p);
    }
    let projection = matrix.projections.iter().find(|p| p.model == w.model).expect("put above");
    let prediction = predict(w, policy, projection)?;
    let cap = common.memory_cap.expect("set by defaults");
    let total = prediction.total();
    let skipped = |error: String| Record {
        status: Status::Skipped,
        error,
        ..Record::new(w, policy, &common.device.to_string())
    };
    let mut rec = match total {
        Some(t) if execution == Execution::DryRun => {
            skipped(format!("dry run (predicted {:.1} GiB)", units::gib(t)))
        }
        Some(t) if t > cap => skipped(format!(
            "does not fit (predicted {:.1} GiB > cap {:.1} GiB)",
            units::gib(t),
            units::gib(cap)
        )),
        None => skipped(format!("not predicted: the planner found no plan for {policy}")),
        Some(_) => {
            let check_fits = prediction.params * 4 + prediction.activations.unwrap_or(0) < cap;
            let mut rec = spawn_one(
                w,
                policy,
                common,
                (profile, None),
                if check_fits { One::Full } else { One::Unchecked },
            );
            rec.grads_checked = check_fits && rec.status == Status::Ok;
            rec
        }
    };
    rec.predicted = Some(prediction);
    rec.predicted_total_bytes = total;
    Ok(Some(rec))
}

/// The prediction for `w` under `policy` from its `projection`: the state by arithmetic
/// ([`state`]), the rest of the projected total as activations (`None` where the
/// projection has no row for the policy: a budget no plan fits).
pub fn predict(
    w: &Workload,
    policy: &PolicyRequest,
    projection: &Projection,
) -> Result<Prediction> {
    let (params, grads, optimizer) = w.state(&w.shapes()?);
    let label = policy.to_string();
    let activations = projection
        .rows
        .iter()
        .find(|r| r.label == label)
        .map(|r| r.total_bytes.saturating_sub(params + grads + optimizer));
    Ok(Prediction { params, grads, optimizer, activations })
}
