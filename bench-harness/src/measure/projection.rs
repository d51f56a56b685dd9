//! `project-one`: a model of the `full` profile projected at its own size by the planner, in
//! this process: its stages profiled one at a time at the full input size, at the article's batch
//! where it is at most [`PROBES`]`.1`, else at the two probe batches and extrapolated to the
//! article's batch; the state (parameters, optimizer, inputs) is arithmetic. Every policy and
//! three planner plans are then predicted.
//!
//! The experiment's other layers: [`crate::run::projection`] (which starts `project-one` for the
//! article's models, and for the predictions of `gpt2-24gb` and `llm-24gb`,
//! [`crate::run::fits_24gb`]) and
//! [`crate::report::projection`] (the projections' section of `TABLE.md`).

use super::one::predict;
use crate::cli::Common;
use crate::report::record::{ProjectedPolicy, Projection};
use crate::workloads::{self, Shapes, Workload, CARD_BYTES};
use anyhow::{Context, Result};
use candle_core::Device;
use remat::memory::tensor_bytes;
use remat::plan::{Estimate, Grads, Profile, Update};
use remat::{Policy, PolicyRequest, StageKind};

/// The batches a projection measures at and extrapolates from, when the article's is larger.
pub const PROBES: (usize, usize) = (8, 16);

/// The blocks of a shallow model a projection profiles and deepens: two, so that the block
/// repeated reads a block's output as every later one does.
pub const SHALLOW: usize = 2;

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

/// Profiles `w` (at its size) and predicts its policies (with its gradient accumulation), the
/// plan with the least recompute that fits `sqrt`'s memory, the plan for a 24 GiB card, and the
/// plan with the least memory. The state is the weights as built plus the optimizer state and
/// one batch of inputs by arithmetic: the optimizer is never built (GPT-2 XL's AdamW moments
/// alone are 12.5 GB), so a model projects wherever its weights and one stage fit. A model that is
/// one run of alike blocks (the Llama family) is built [`SHALLOW`] blocks deep, profiled, and its
/// profile deepened to its depth (`remat::plan::Profile::deepened`), its weights by arithmetic:
/// Llama-3.1-8B projects without its 32 GB of f32 weights.
pub fn project(w: &Workload, device: &Device, seed: u64) -> Result<Projection> {
    let (inst, deepen) = match w.build_shallow(SHALLOW, device, seed)? {
        Some((inst, depth)) if depth > SHALLOW => (inst, depth - SHALLOW),
        _ => (w.build(device, seed)?, 0),
    };
    let store = inst.store();
    let buffers = store.buffers().map(|(_, b)| tensor_bytes(b.as_tensor())).sum::<u64>();
    let (weights, _, optimizer) =
        w.state(&if deepen > 0 { w.shapes()? } else { Shapes::of(store) });
    let inputs = inst.inputs_at(0, 1)?.iter().map(tensor_bytes).sum::<u64>() * w.batch as u64;
    let state_bytes = weights + buffers + optimizer + inputs;
    let inputs_at = |n| inst.inputs_at(0, n);
    let vars = inst.store().vars();
    let profile = if w.batch <= PROBES.1 {
        Profile::at_batch(inst.graph(), inputs_at, &vars, w.batch, seed)?
    } else {
        Profile::extrapolated(inst.graph(), inputs_at, &vars, PROBES, w.batch, seed)?
    };
    let profile = match deepen {
        0 => profile,
        extra => {
            let last_block = profile.stages.iter().rposition(|s| s.kind == StageKind::Block);
            let last_block = last_block.context("a shallow model without blocks")?;
            profile.deepened(last_block, extra)?
        }
    };
    // Accumulating, every micro-batch after the first holds all parameter gradients.
    let grads = Grads::of(&profile, w.accumulate, Update::from_flag(w.in_backward));
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
    rows.push(row(
        "budget = sqrt's memory".into(),
        at_sqrt.policy().to_string(),
        &at_sqrt.estimate,
    ));
    // A card the model does not fit at any plan has no row for it.
    if let Ok(card) = profile.plan(CARD_BYTES, state_bytes, grads) {
        rows.push(row(
            PolicyRequest::Budget(CARD_BYTES).to_string(),
            card.policy().to_string(),
            &card.estimate,
        ));
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
