//! One configuration, measured in this (fresh) process: a warm-up step, timed steps, and a
//! bit-for-bit gradient check against plain candle (the graph's stages run in order, one
//! `backward()`), which every policy, `off` included, must equal.
//!
//! The matrices' other layers: [`crate::run::child`] (starts `run-one`, reads its record back),
//! [`crate::run::matrix`] (which configurations, the timing rounds) and
//! [`crate::report::record::Record`] (what it prints).

use crate::cli::Common;
use crate::report::record::{FrontierPoint, Record, Status};
use crate::report::units::gib_text;
use crate::workloads::{self, Instance, Shapes, Workload};
use anyhow::{anyhow, Context, Result};
use candle_core::Device;
use remat::memory::{set_activity, Activity, Counter};
use remat::plan::{Estimate, Grads, Profile, Update};
use remat::{Executor, Policy, PolicyRequest};
use std::collections::BTreeMap;
use std::path::Path;

/// What a `run-one` process does.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum One {
    /// Timed steps and the gradient check.
    Full,
    /// Timed steps and the prediction, no gradient check.
    Unchecked,
    /// Timed steps only (a timing round).
    TimeOnly,
    /// The prediction only.
    DryRun,
}

/// What the gradient check's recomputes draw their dropout keys from: the forward's, replayed (a
/// real check), or fresh ones (`--no-rng-replay`, [`remat::Executor::without_rng_replay`]: the
/// negative control, which exists only to show that the check can fail).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecomputeRng {
    Replayed,
    Fresh,
}

/// `run-one`: one configuration measured in this process, on the ranks `mpirun` started.
pub fn run_one(
    model: &str,
    policy: &PolicyRequest,
    mode: One,
    profiles: Option<&Path>,
    common: &Common,
) -> Result<()> {
    ops::fused::set_path(common.fused_path.into());
    let dev = common.device.open()?;
    let group = trainkit::Group::from_launcher(&dev)?;
    trainkit::or_abort(&group, measure_one(model, policy, (mode, profiles), common, &group, &dev))
}

/// `run-one` on one rank of `group`, on `dev`: the first rank prints the record.
fn measure_one(
    model: &str,
    policy: &PolicyRequest,
    (mode, profiles): (One, Option<&Path>),
    common: &Common,
    group: &trainkit::Group,
    dev: &candle_core::Device,
) -> Result<()> {
    // Held while the configuration is measured: the device memory beyond the cap.
    let held = match common.memory_cap {
        Some(cap) => hold_beyond(dev, cap)?,
        None => None,
    };
    let workloads: Vec<_> = workloads::profile(common.profile())
        .into_iter()
        .chain(workloads::depth_sweep(common.profile()))
        .collect();
    let names = || workloads.iter().map(|w| w.model.clone()).collect::<Vec<_>>().join(", ");
    let w = workloads
        .iter()
        .find(|w| w.model == model)
        .with_context(|| {
            format!("model `{model}` is not in profile `{}`; it has: {}", common.profile(), names())
        })?
        .clone()
        .overridden(common.overrides());
    let device_name = common.device.to_string();
    let at = Setting {
        device: dev,
        device_name: &device_name,
        seed: common.seed,
        steps: if mode == One::DryRun { 0 } else { common.steps },
        cap: common.memory_cap,
        predict_step: mode != One::TimeOnly,
        profiles,
        group,
    };
    let mut rec = run(&w, policy, &at)?;
    if ops::fused::path() == ops::fused::Path::Generic {
        rec.fused_path = "generic".into();
    }
    // The cap is for the measured configuration only: the check builds two more models.
    drop(held);
    remat::memory::set_heap_cap(u64::MAX);
    if !group.is_root() {
        return Ok(());
    }
    if mode == One::Full && rec.status == Status::Ok && rec.check_skipped.is_empty() {
        // A budget is checked as the plan it resolved to (one process's step: the ranks'
        // agreement is the parameter check in `measure::run`).
        let checked: Policy = match policy.fixed() {
            Some(p) if rec.plan.is_empty() => p.clone(),
            _ => rec.plan.parse()?,
        };
        let rng = if common.no_rng_replay { RecomputeRng::Fresh } else { RecomputeRng::Replayed };
        check(&mut rec, &w, &checked, common.seed, dev, rng)?;
    }
    println!("{}", serde_json::to_string(&rec)?);
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

/// How the record of a configuration whose step the planner predicts beyond this machine's
/// memory begins its reason.
pub const STEP_DOES_NOT_FIT: &str = "predicted only: a step needs";

/// The planner's profile of `inst` at its batch, measured at that batch ([`Profile::at_batch`]).
pub fn profile(inst: &dyn Instance, seed: u64) -> Result<Profile> {
    Ok(Profile::at_batch(
        inst.graph(),
        |n| inst.inputs_at(0, n),
        &inst.store().vars(),
        inst.batch(),
        seed,
    )?)
}

/// A profile kept in a results folder (`profiles/<model>.json`) for the other policies of the
/// same model, with what it was measured for.
#[derive(serde::Serialize, serde::Deserialize)]
struct SharedProfile {
    measured_for: String,
    profile: Profile,
}

/// [`profile`], shared by the policies of a model through the folder `dir`: the one there is
/// read where it was measured for the same configuration (model, batch, input, dtype, device,
/// threads, ranks, fused path) by the same harness executable, else it is measured and written
/// there (by the first rank). At full size this saves a profile per policy: ResNet-50 at batch
/// 256 profiles for minutes.
fn shared_profile(
    dir: Option<&Path>,
    w: &Workload,
    inst: &dyn Instance,
    device_name: &str,
    seed: u64,
    group: &trainkit::Group,
) -> Result<Profile> {
    let Some(dir) = dir else { return profile(inst, seed) };
    // The executable, by its size and time of writing: a rebuilt harness measures anew.
    let exe = std::env::current_exe().and_then(std::fs::metadata)?;
    let built = exe.modified()?.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let measured_for = format!(
        "{} batch {} {} {} on {device_name}, {} threads, {} ranks, {:?} fused path, seed {seed}; \
         by the harness of {} bytes built at {built} s (commit {})",
        w.model,
        inst.batch(),
        w.input(),
        w.dtype,
        candle_core::utils::get_num_threads(),
        group.world(),
        ops::fused::path(),
        exe.len(),
        crate::report::results::commit()
    );
    let path = dir.join(format!("{}.json", w.model.replace('/', "+")));
    let kept = std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice::<SharedProfile>(&b).ok())
        .filter(|k| k.measured_for == measured_for);
    if let Some(kept) = kept {
        return Ok(kept.profile);
    }
    let profile = profile(inst, seed)?;
    if group.is_root() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let shared = SharedProfile { measured_for, profile };
        crate::report::write_file(&path, serde_json::to_vec_pretty(&shared)?)?;
        return Ok(shared.profile);
    }
    Ok(profile)
}

/// The predicted step of `policy` on `w`: with several micro-batches the first gathers the
/// parameter gradients and later ones hold them all from the start, so the higher of the two.
pub fn predict(profile: &Profile, policy: &Policy, w: &Workload) -> Result<Estimate> {
    let grads = Grads::of(profile, w.accumulate, Update::from_flag(w.in_backward));
    if w.accumulate == 1 {
        return Ok(profile.predict_policy(policy, grads)?);
    }
    let first = profile.predict_policy(policy, Grads::Gathered)?;
    let later = profile.predict_policy(policy, grads)?;
    Ok(if later.peak > first.peak {
        Estimate { recompute_ms: first.recompute_ms, step_ms: first.step_ms, ..later }
    } else {
        first
    })
}

/// Where and how [`run`] measures a configuration.
pub struct Setting<'a> {
    pub device: &'a Device,
    /// The device as the record names it (`cpu`, `cuda:0`).
    pub device_name: &'a str,
    pub seed: u64,
    /// Timed steps after the warm-up step; 0 predicts only (a dry run).
    pub steps: usize,
    /// The memory the run may use (`--memory-cap`), which `auto` plans for.
    pub cap: Option<u64>,
    /// Whether the planner profiles the model first and predicts the step (the timing rounds,
    /// which keep only the step time, predict nothing).
    pub predict_step: bool,
    /// A folder where the model's policies share one profile ([`shared_profile`]).
    pub profiles: Option<&'a Path>,
    pub group: &'a trainkit::Group,
}

/// Measures `policy` on `w`: a warm-up step, then the timed steps (the record's status is `ok`,
/// its gradient fields still empty: see [`check`]); with no timed steps it predicts only (status
/// `skipped`). A `budget=`/`auto` policy is resolved from a profile either way. A configuration
/// whose state or step the planner puts beyond this machine's memory is recorded as skipped,
/// with the arithmetic.
pub fn run(w: &Workload, policy: &PolicyRequest, at: &Setting) -> Result<Record> {
    let mut rec = Record::new(w, policy, at.device_name);
    let counter = Counter::for_device(at.device);
    counter.synchronize();
    let base = counter.current();
    // What this process may hold: the heap now and what the machine can still give, less a
    // tenth (the allocator's slack, the page cache, the harness). Under a memory cap, which
    // emulates a smaller device, a step that does not fit runs and ends out of memory, as it
    // would there.
    let room = if at.cap.is_some() {
        None
    } else {
        trainkit::free_memory(at.device).map(|free| base + free - free / 10)
    };
    // A batch no step here could hold is refused as the trainers refuse it, before anything
    // is built (building and profiling it would run for minutes and end out of memory).
    if at.predict_step {
        let (what, elements) = w.step_floor();
        if let Err(e) = trainkit::check_footprint("--batch x --input-size", what, elements) {
            return Ok(rec.skipped(format!("predicted only: {e:#}")));
        }
    }
    // Held from here on, as the model is: part of the state before a step, never of a step.
    ops::allocate_matmul_workspaces();
    set_activity(Activity::Build, None);
    let inst = w.build(at.device, at.seed)?;
    if let Some(reason) =
        room.filter(|_| at.predict_step).and_then(|room| state_beyond(w, &*inst, room))
    {
        return Ok(rec.skipped(reason));
    }
    let mut optimizer = inst.optimizer(w.shard_optimizer, at.group)?;
    let (policy, off_total) = match (policy.fixed(), at.predict_step) {
        (Some(p), false) => (p.clone(), None),
        _ => plan(&mut rec, w, &*inst, &*optimizer, policy, at)?,
    };
    if at.steps == 0 {
        return Ok(rec.skipped("dry run".into()));
    }
    if let (Some(room), Some(total)) = (room, rec.predicted_total_bytes) {
        if total > room {
            let reason = format!(
                "{STEP_DOES_NOT_FIT} {} in all by the planner's prediction, and this machine can \
                 give {}",
                gib_text(total),
                gib_text(room)
            );
            return Ok(rec.skipped(reason));
        }
        // The check runs plain candle's step and then ours, each on a fresh model, holding a
        // copy of the first's gradients meanwhile: where two steps of `off`'s size do not fit,
        // it is skipped and the record says why.
        if let Some(off) = off_total.filter(|&off| 2 * off > room) {
            rec.check_skipped = format!(
                "two steps of `off` ({} each by the planner's prediction) do not fit the {} this \
                 machine can give",
                gib_text(off),
                gib_text(room)
            );
        }
    }
    let exec = Executor::new(
        inst.graph(),
        &policy,
        inst.store().vars(),
        trainkit::rank_seed(at.seed, at.group.rank()),
    )?;
    rec.segments = exec.segments().len();
    rec.ranks = at.group.world();
    rec.segment_ranges = exec.segments().iter().map(|r| [r.start, r.end]).collect();
    timed_steps(&mut rec, w, &*inst, &exec, optimizer.as_mut(), at, base)?;
    rec.reserved_bytes = counter.reserved();
    if at.group.world() > 1 {
        trainkit::parallel::check_in_sync(at.group, inst.store())?;
    }
    rec.status = Status::Ok;
    Ok(rec)
}

/// Why a model's state alone does not fit in `room` (GPT-2 XL's f32 weights, gradients and AdamW
/// moments are 25 GB), by arithmetic on its parameter shapes; `None` where it fits. Such a
/// configuration gets no optimizer.
fn state_beyond(w: &Workload, inst: &dyn Instance, room: u64) -> Option<String> {
    let (params, grads, optimizer) = w.state(&Shapes::of(inst.store()));
    let state = params + grads + optimizer;
    (state > room).then(|| {
        format!(
            "predicted only: its weights, gradients and optimizer state alone are {} (by \
             arithmetic on the parameter shapes), and this machine can give {}",
            gib_text(state),
            gib_text(room)
        )
    })
}

/// A warm-up step and `at.steps` timed steps of `exec` on `inst`, into `rec`: the step time
/// (median and range), the peaks, the loss, the first timed step's memory timeline; with several
/// ranks, the time in all-reduces. `base`: the heap before the model was built.
fn timed_steps(
    rec: &mut Record,
    w: &Workload,
    inst: &dyn Instance,
    exec: &Executor,
    optimizer: &mut dyn optim::TrainOptimizer,
    at: &Setting,
    base: u64,
) -> Result<()> {
    let group = at.group;
    // Every rank draws the global batch and keeps its rows (the ranks see it whole between them).
    let inputs = |n: u64| -> Result<Vec<candle_core::Tensor>> {
        Ok(group.shard(inst.inputs_at(n, inst.batch() * group.world())?)?)
    };
    let (mut comm_ms, mut wait_ms) = (Vec::new(), Vec::new());
    let (mut times, mut faults) = (Vec::new(), Vec::new());
    // f16 trains under dynamic loss scaling, as the trainers do.
    let mut scaler = (w.dtype == trainable::Precision::F16).then(trainkit::LossScaler::default);
    let stepper = trainkit::Stepper {
        group,
        exec,
        accumulate: w.accumulate,
        in_backward: w.in_backward,
        batch_names: None,
    };
    for step in 0..=at.steps as u64 {
        let comm_before = group.comm_time();
        let faults_before = remat::memory::minor_faults();
        let out = stepper.step(step, scaler.as_mut(), inputs, optimizer)?;
        let comm = group.comm_time();
        if step == 0 {
            continue; // warm-up: first-touch page faults, lazily built kernels and caches
        }
        if !out.updated {
            rec.skipped_updates += 1;
        }
        let usage = out.usage;
        times.push(usage.elapsed_ms);
        faults.extend(
            faults_before.zip(remat::memory::minor_faults()).map(|(before, after)| after - before),
        );
        comm_ms.push((comm.all_reduce - comm_before.all_reduce).as_secs_f64() * 1e3);
        wait_ms.push((comm.waited - comm_before.waited).as_secs_f64() * 1e3);
        rec.model_state_bytes = usage.heap_base.saturating_sub(base);
        rec.step_peak_bytes = rec.step_peak_bytes.max(usage.heap_peak_delta);
        rec.fwd_bwd_peak_bytes = rec.fwd_bwd_peak_bytes.max(out.fwd_bwd_peak);
        rec.activation_peak_bytes = rec.activation_peak_bytes.max(out.activation_peak);
        rec.rss_peak_delta_bytes = rec.rss_peak_delta_bytes.max(usage.rss_peak_delta.unwrap_or(0));
        rec.loss = out.loss as f32;
        if rec.timeline.is_empty() {
            rec.timeline = out.timeline.events;
            rec.timeline_base_bytes = usage.heap_base;
        }
    }
    if group.world() > 1 {
        ranks_summary(rec, group, comm_ms, wait_ms)?;
    }
    times.sort_by(f64::total_cmp);
    rec.timed_steps = times.len();
    rec.step_ms_median = times[times.len() / 2];
    rec.step_ms_min = times[0];
    rec.step_ms_max = times[times.len() - 1];
    faults.sort_unstable();
    rec.minor_faults_per_step = faults.get(faults.len() / 2).copied();
    Ok(())
}

/// With several ranks: the median time in all-reduces and waiting for them per step, and the
/// largest rank's state and step peak.
fn ranks_summary(
    rec: &mut Record,
    group: &trainkit::Group,
    comm_ms: Vec<f64>,
    wait_ms: Vec<f64>,
) -> Result<()> {
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    rec.all_reduce_ms = Some(median(comm_ms));
    rec.all_reduce_wait_ms = Some(median(wait_ms));
    rec.step_peak_bytes_max_rank = Some(group.min_max(rec.step_peak_bytes)?.1);
    rec.model_state_bytes_max_rank = Some(group.min_max(rec.model_state_bytes)?.1);
    Ok(())
}

/// Profiles `inst` for the planner: a `budget=`/`auto` policy resolved (the ranks agreeing on
/// one plan, kept in `rec.plan`), and with `at.predict_step` the step predicted into `rec` (for
/// `off`, with the planner's memory/time frontier). Returns the policy to run and, with
/// `at.predict_step`, `off`'s predicted total (the state and its step's peak).
fn plan(
    rec: &mut Record,
    w: &Workload,
    inst: &dyn Instance,
    optimizer: &dyn optim::TrainOptimizer,
    policy: &PolicyRequest,
    at: &Setting,
) -> Result<(Policy, Option<u64>)> {
    let (device, group) = (at.device, at.group);
    let profile = shared_profile(at.profiles, w, inst, at.device_name, at.seed, group)?;
    // After the profile: the workspaces kernels keep from their first calls are part of it.
    let inputs_bytes: u64 = inst.inputs(0)?.iter().map(remat::memory::tensor_bytes).sum();
    let fixed = trainkit::memory_before_step(device, optimizer, inputs_bytes)?;
    let grads = Grads::of(&profile, w.accumulate, Update::from_flag(w.in_backward));
    let planned = policy.fixed().is_none();
    let (resolved, _) = remat::plan::resolve(
        policy,
        &profile,
        fixed,
        grads,
        trainkit::auto_budget(device, at.cap),
    )?;
    let policy = trainkit::parallel::agreed_policy(group, policy, resolved)?;
    if planned {
        rec.plan = policy.to_string();
    }
    // Known before the step runs, for a baseline of a configuration that is not run.
    rec.segment_ranges =
        policy.segments_of(&profile.kinds())?.iter().map(|r| [r.start, r.end]).collect();
    if at.predict_step {
        let estimate = predict(&profile, &policy, w)?;
        if policy == Policy::Off {
            let points = remat::plan::frontier(&profile, fixed, grads, 16);
            rec.frontier = points
                .iter()
                .map(|p| FrontierPoint {
                    plan: p.policy().to_string(),
                    peak_bytes: p.estimate.peak,
                    time_ratio: p.estimate.time_ratio(),
                })
                .collect();
        }
        rec.predicted_peak_bytes = Some(estimate.peak);
        rec.predicted_total_bytes = Some(fixed + estimate.peak);
        rec.predicted_time_ratio = Some(estimate.time_ratio());
        rec.estimate = Some(estimate);
        let off = predict(&profile, &Policy::Off, w)?;
        return Ok((policy, Some(fixed + off.peak)));
    }
    Ok((policy, None))
}

/// Checks `policy` on `w` against plain candle and fills the record's gradient fields (run it
/// after [`run`], once the model is freed and any memory cap lifted: the check builds two more
/// models). `rng`: [`RecomputeRng::Replayed`] but in the negative control.
pub fn check(
    rec: &mut Record,
    w: &Workload,
    policy: &Policy,
    seed: u64,
    device: &Device,
    rng: RecomputeRng,
) -> Result<()> {
    set_activity(Activity::GradCheck, None);
    let check = gradcheck(w, policy, seed, device, rng)?;
    rec.grads_checked = true;
    rec.grads_bit_identical = check.differing == 0;
    rec.grads_differing = check.differing;
    rec.max_abs_diff = check.max_abs_diff;
    rec.params_without_grad = check.without_grad;
    Ok(())
}

struct GradCheck {
    differing: u64,
    max_abs_diff: f64,
    without_grad: usize,
}

/// What one step leaves behind: gradient bits and buffer bits (BatchNorm statistics), by name.
type Fingerprint = (BTreeMap<String, Vec<u32>>, BTreeMap<String, Vec<u32>>);

/// Step 0 in plain candle: [`remat::StageGraph::plain_loss`] and one `backward()`, on a freshly
/// built model. It shares no code with the executor, so the executor's `off` is checked too.
fn plain_step(w: &Workload, seed: u64, device: &Device) -> Result<Fingerprint> {
    let inst = w.build(device, seed)?;
    let grads = inst.graph().plain_loss(&inst.inputs(0)?, seed, 0)?.backward()?;
    Ok((inst.store().grad_bits(&grads)?, inst.store().buffer_bits()?))
}

/// Step 0 through the executor under `policy`, on a freshly built model; and how many parameters
/// the model has.
fn executor_step(
    w: &Workload,
    policy: &Policy,
    seed: u64,
    device: &Device,
    rng: RecomputeRng,
) -> Result<(Fingerprint, usize)> {
    let inst = w.build(device, seed)?;
    let mut exec = Executor::new(inst.graph(), policy, inst.store().vars(), seed)?;
    if rng == RecomputeRng::Fresh {
        exec = exec.without_rng_replay();
    }
    let out = exec.step(&inst.inputs(0)?, 0)?;
    Ok((
        (inst.store().grad_bits(&out.grads)?, inst.store().buffer_bits()?),
        inst.store().vars().len(),
    ))
}

/// One step in plain candle and one through the executor under `policy` (`off` included), on
/// identical weights, batch and seed: every gradient element and every buffer element compared
/// bit for bit; and every parameter must receive a non-zero gradient.
fn gradcheck(
    w: &Workload,
    policy: &Policy,
    seed: u64,
    device: &Device,
    rng: RecomputeRng,
) -> Result<GradCheck> {
    let (ref_grads, ref_bufs) = plain_step(w, seed, device)?;
    let ((grads, bufs), n_params) = executor_step(w, policy, seed, device, rng)?;
    let zero = grads.values().filter(|g| g.iter().all(|&x| f32::from_bits(x) == 0.0)).count();
    let mut check =
        GradCheck { differing: 0, max_abs_diff: 0.0, without_grad: n_params - grads.len() + zero };
    let pairs = ref_grads
        .iter()
        .map(|(n, a)| (a, grads.get(n)))
        .chain(ref_bufs.iter().map(|(n, a)| (a, bufs.get(n))));
    for (a, b) in pairs {
        match b {
            Some(b) if a.len() == b.len() => {
                for (&x, &y) in a.iter().zip(b) {
                    if x != y {
                        check.differing += 1;
                        check.max_abs_diff = check
                            .max_abs_diff
                            .max((f32::from_bits(x) - f32::from_bits(y)).abs() as f64);
                    }
                }
            }
            Some(_) => {
                return Err(anyhow!("tensor shapes differ between plain candle and {policy}"))
            }
            None => check.differing += a.len() as u64,
        }
    }
    Ok(check)
}
