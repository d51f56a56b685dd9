//! Before training: what the machine can give, a step that cannot fit refused, the policy
//! planned (`budget=`, `auto`, `--memory-cap`) and `--dry-run`'s prediction.

use crate::args::RunArgs;
use crate::parallel::{self, Group};
use crate::{say, segments, show};
use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use remat::memory::{gib, mib};
use remat::plan::{Grads, Profile, Update};
use remat::Executor;

/// This machine's available memory in bytes (MemAvailable + SwapFree), where /proc/meminfo says.
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = |field: &str| {
        meminfo.lines().find_map(|l| {
            l.strip_prefix(field)?.trim().trim_end_matches("kB").trim().parse::<u64>().ok()
        })
    };
    Some((kib("MemAvailable:")? + kib("SwapFree:")?) * 1024)
}

/// The memory a training step starts from, as a budget or a memory cap counts it: everything the
/// device holds now (weights, buffers, data, the optimizer state allocated so far), the optimizer
/// state still to come (SGD's buffers appear at the first update), and one batch of inputs.
pub fn memory_before_step(
    device: &Device,
    optimizer: &dyn optim::TrainOptimizer,
    inputs_bytes: u64,
) -> Result<u64> {
    let counter = remat::memory::Counter::for_device(device);
    counter.synchronize();
    let allocated: u64 = optimizer.state()?.values().map(remat::memory::tensor_bytes).sum();
    Ok(counter.current() + optimizer.state_bytes().saturating_sub(allocated) + inputs_bytes)
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
                "{flags}: {what} alone: {:.1} GiB (f32); this machine has {:.1} GiB available",
                gib(bytes),
                gib(have)
            );
        }
    }
    Ok(())
}

/// What the device can still give: free memory on a GPU, available memory on the CPU.
pub fn free_memory(device: &Device) -> Option<u64> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            d.cuda_stream().context().mem_get_info().ok().map(|(free, _)| free as u64)
        }
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
    let hint = format!(
        "the model does not fit in this machine's available memory: choose a smaller one ({flags})"
    );
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
/// the flags that set the step's size. The profiles themselves run [`within_memory`]. Returns
/// the profile where it measured at `batch` itself (1 or 2), with the heap the measuring took
/// beyond the model: that is the plan's profile too, measured once.
fn check_step_fits(
    run: &RunArgs,
    model: &impl trainable::Model,
    optimizer: &dyn optim::TrainOptimizer,
    sizes: &str,
    inputs_at: &dyn Fn(usize) -> Result<Vec<Tensor>>,
) -> Result<Option<(Profile, u64)>> {
    let (policy, batch) = (&run.policy, run.batch);
    let (vars, device) = vars_and_device(model);
    let Some(free) = free_memory(&device) else { return Ok(None) };
    let hint = format!(
        "a training step does not fit in this machine's available memory: make it smaller ({sizes})"
    );
    // At batch 1 or 2, this is the plan's profile too; at larger batches, extrapolated (its
    // temporaries over-predict a little), and a plan measures at the batch itself.
    let measure = |n: usize| -> Result<Profile> {
        Ok(Profile::measure(model.graph(), &inputs_at(n)?, &vars, n, run.seed)?)
    };
    let (profile, measuring_peak) = remat::memory::peak_during(|| {
        within_memory(hint, || {
            Ok(match batch {
                1 | 2 => measure(batch)?,
                _ => Profile::extrapolate(&measure(1)?, &measure(2)?, batch)?,
            })
        })
    });
    let profile = profile?;
    let (fixed, grads) = step_start(run, &device, optimizer, &profile, inputs_at)?;
    let least = profile.least_peak(grads);
    let peak = match policy.fixed() {
        Some(policy) => profile.predict_policy(policy, grads)?.peak,
        None => least.estimate.peak,
    };
    // What is already allocated (the model) is not asked of the free memory again.
    let more = fixed
        .saturating_sub(remat::memory::Counter::for_device(&device).current())
        .saturating_add(peak);
    if more > free {
        let other = if least.estimate.peak < peak {
            format!(
                " (the least any checkpoint plan needs is {:.1} GiB: {})",
                gib(least.estimate.peak),
                least.policy()
            )
        } else {
            String::new()
        };
        bail!(
            "{sizes}: a training step under {policy} needs {:.1} GiB beyond the model by the \
             planner's prediction{other}; this device has {:.1} GiB available. Make the step \
             smaller",
            gib(more),
            gib(free)
        );
    }
    Ok(matches!(batch, 1 | 2).then_some((profile, measuring_peak)))
}

/// A model's parameters and the device they are on.
fn vars_and_device(model: &impl trainable::Model) -> (Vec<candle_core::Var>, Device) {
    let vars = model.params().vars();
    let device = vars.first().map_or(Device::Cpu, |v| v.device().clone());
    (vars, device)
}

/// What a step of `--batch` starts from, as the planner counts it: the memory before the step
/// ([`memory_before_step`] with a batch of inputs; called after profiling, so the workspaces
/// kernels keep from their first calls are part of it), and what the step does with parameter
/// gradients (held across micro-batches under `--accumulate`, applied as they finish under
/// `--optimizer-in-backward`).
fn step_start(
    run: &RunArgs,
    device: &Device,
    optimizer: &dyn optim::TrainOptimizer,
    profile: &remat::plan::Profile,
    inputs_at: &dyn Fn(usize) -> Result<Vec<Tensor>>,
) -> Result<(u64, Grads)> {
    let inputs: u64 = inputs_at(1)?
        .iter()
        .map(remat::memory::tensor_bytes)
        .sum::<u64>()
        .saturating_mul(run.batch as u64);
    Ok((
        memory_before_step(device, optimizer, inputs)?,
        Grads::of(profile, run.accumulate, Update::from_flag(run.optimizer_in_backward)),
    ))
}

/// `--policy budget=SIZE`/`auto` and `--dry-run`: profiles the model's stages one at a time at
/// the run's batch ([`remat::plan::Profile::at_batch`]: one stage's memory, not a step's).
/// Returns the executor to train with and its policy (a budget resolved to its plan), or `None`
/// after a dry run, which prints the prediction per phase for the policy and the fixed policies
/// and trains nothing. `inputs_at(n)`: the graph inputs of a batch of `n`. First, a step the
/// device cannot hold is refused ([`check_step_fits`]; `sizes` names the flags that set its size).
pub fn executor<'m>(
    run: &RunArgs,
    group: &Group,
    model: &'m impl trainable::Model,
    optimizer: &dyn optim::TrainOptimizer,
    sizes: &str,
    inputs_at: &dyn Fn(usize) -> Result<Vec<Tensor>>,
) -> Result<Option<(Executor<'m>, remat::Policy)>> {
    let measured = check_step_fits(run, model, optimizer, sizes, inputs_at)?;
    let Some(resolved) = plan_policy(run, model, optimizer, inputs_at, measured)? else {
        return Ok(None);
    };
    let policy = parallel::agreed_policy(group, &run.policy, resolved)?;
    Ok(Some((
        Executor::new(
            model.graph(),
            &policy,
            model.params().vars(),
            rank_seed(run.seed, group.rank()),
        )?,
        policy,
    )))
}

/// The random keys of rank `rank`: rank 0 draws those of a one-rank run, the others their own
/// (ranks must not share dropout masks); checkpointing replays each rank's keys on recompute.
pub fn rank_seed(seed: u64, rank: usize) -> u64 {
    remat::rng::derive_seed(seed, rank as u64)
}

fn plan_policy(
    run: &RunArgs,
    model: &impl trainable::Model,
    optimizer: &dyn optim::TrainOptimizer,
    inputs_at: &dyn Fn(usize) -> Result<Vec<Tensor>>,
    measured: Option<(Profile, u64)>,
) -> Result<Option<remat::Policy>> {
    use remat::plan::resolve;
    let (policy, batch) = (&run.policy, run.batch);
    if let (Some(policy), false, None) = (policy.fixed(), run.dry_run, run.memory_cap) {
        return Ok(Some(policy.clone()));
    }
    let (vars, device) = vars_and_device(model);
    // The fit check's profile where it measured at this batch (GPT-2 XL's dry run: one
    // measurement instead of three).
    let (profile, dry_peak) = match measured {
        Some(measured) => measured,
        None => {
            let (profile, peak) = remat::memory::peak_during(|| {
                Profile::at_batch(model.graph(), inputs_at, &vars, batch, run.seed)
            });
            (profile?, peak)
        }
    };
    let (fixed, grads) = step_start(run, &device, optimizer, &profile, inputs_at)?;
    let (resolved, plan) =
        resolve(policy, &profile, fixed, grads, auto_budget(&device, run.memory_cap))?;
    if let (Some(cap), None, false) = (run.memory_cap, &plan, run.dry_run) {
        // A fixed policy under a cap: refused now if the planner says it cannot fit, where the
        // run would otherwise end at the allocation that crosses the cap.
        let need = fixed + profile.predict_policy(&resolved, grads)?.peak;
        if need > cap {
            let least = profile.least_peak(grads);
            bail!(
                "--policy {resolved} needs {:.1} MiB by the planner's prediction (state before the \
                 step {:.1} MiB), above --memory-cap {:.1} MiB; the least any checkpoint plan \
                 needs is {:.1} MiB ({}), and --policy auto picks the fastest plan that fits",
                mib(need),
                mib(fixed),
                mib(cap),
                mib(fixed + least.estimate.peak),
                least.policy()
            );
        }
    }
    if let Some(plan) = &plan {
        say!(
            "{policy}: {} ({}), predicted {:.1} MiB in all",
            resolved,
            segments(plan.starts.len()),
            mib(fixed + plan.estimate.peak)
        );
    }
    if !run.dry_run {
        return Ok(Some(resolved));
    }
    print_dry_run(&profile, &resolved, (fixed, grads), dry_peak)?;
    Ok(None)
}

/// `--dry-run`'s prediction: the profile, then per phase the step under `resolved` and the
/// fixed policies, and the least memory any plan needs, from the state before a step and what
/// the step does with gradients (`fixed`, `grads`); `dry_peak`: the heap profiling took.
fn print_dry_run(
    profile: &Profile,
    resolved: &remat::Policy,
    (fixed, grads): (u64, Grads),
    dry_peak: u64,
) -> Result<()> {
    use remat::plan::summary;
    show!("{}", remat::plan::describe(profile));
    show!("memory before a step (weights, optimizer state, data, inputs): {:.1} MiB", mib(fixed));
    let mut policies = vec![resolved.clone()];
    policies.extend(
        [remat::Policy::Off, remat::Policy::Sqrt, remat::Policy::EveryN(2)]
            .into_iter()
            .filter(|q| q != resolved),
    );
    for q in policies {
        let e = profile.predict_policy(&q, grads)?;
        show!("{q}: total {:.1} MiB; {}", mib(fixed + e.peak), summary(&e));
    }
    let least = profile.least_peak(grads);
    show!(
        "least memory: {} total {:.1} MiB; {}",
        least.policy(),
        mib(fixed + least.estimate.peak),
        summary(&least.estimate)
    );
    show!(
        "dry run: trained nothing; profiling used {:.1} MiB of heap beyond the model",
        mib(dry_peak)
    );
    Ok(())
}
