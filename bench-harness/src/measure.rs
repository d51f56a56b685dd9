//! One configuration, measured in this (fresh) process: a warm-up step, timed steps, and a
//! bit-for-bit gradient check against plain candle (the graph's stages run in order, one
//! `backward()`), which every policy, `off` included, must equal.

use crate::workloads::Instance;
use crate::workloads::Workload;
use anyhow::{anyhow, Result};
use candle_core::Device;
use remat::memory::{set_activity, Activity, Counter, Event};
use remat::plan::{Estimate, Profile};
use remat::{Executor, Policy};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One row of the matrix. Byte figures are heap bytes from the counting allocator (CPU).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Record {
    pub model: String,
    pub policy: String,
    pub batch: usize,
    /// Micro-batches of `batch` per optimizer step (gradient accumulation); a timed step is all
    /// of them and the update.
    #[serde(default = "one")]
    pub accumulate: usize,
    /// f16: timed steps whose update the loss scaler skipped (non-finite gradients).
    #[serde(default)]
    pub skipped_updates: usize,
    /// `sgd`, `adamw` or `adafactor` (empty in records from before the choice existed, which
    /// used the model's default).
    #[serde(default)]
    pub optimizer: String,
    pub input: String,
    pub dtype: String,
    pub device: String,
    pub threads: usize,
    /// Held before a step: parameters, optimizer state, the step's inputs.
    pub model_state_bytes: u64,
    /// Highest heap during a whole step (forward, backward, optimizer) above `model_state_bytes`.
    pub step_peak_bytes: u64,
    /// Highest heap during forward and backward (the executor's step) above `model_state_bytes`;
    /// when `step_peak_bytes` is higher, the optimizer update set the step's peak.
    pub fwd_bwd_peak_bytes: u64,
    /// Highest heap during forward and backward above `model_state_bytes`, less the parameter
    /// gradients held at that point: what checkpointing acts on.
    pub activation_peak_bytes: u64,
    /// Peak RSS during a step minus RSS at its start.
    pub rss_peak_delta_bytes: u64,
    /// GPU only: bytes the device memory pool holds reserved after the timed steps.
    #[serde(default)]
    pub reserved_bytes: Option<u64>,
    pub step_ms_median: f64,
    pub step_ms_min: f64,
    pub step_ms_max: f64,
    pub timed_steps: usize,
    pub segments: usize,
    /// The stage ranges `[start, end)` of the segments (what the PyTorch baseline replays).
    #[serde(default)]
    pub segment_ranges: Vec<[usize; 2]>,
    /// Step time over `off`'s, one ratio per timing round (this run's, then the interleaved
    /// rounds: off, policy, off, policy, ... in fresh processes). `None` for `off`.
    #[serde(default)]
    pub time_vs_off: Option<Spread>,
    pub loss: f32,
    /// Every gradient and buffer element equals plain candle's bit for bit (see [`run`]).
    pub grads_bit_identical: bool,
    /// Whether the gradient check ran (`gpt2-24gb` skips it where it would need more memory than
    /// the machine has: two models and a copy of every gradient).
    #[serde(default = "yes")]
    pub grads_checked: bool,
    /// `gpt2-24gb`: what the configuration was predicted to need ([`crate::predict`]), and its
    /// total (the state, the gradients and the activations at the step's peak).
    #[serde(default)]
    pub predicted: Option<crate::predict::Prediction>,
    #[serde(default)]
    pub predicted_total_bytes: Option<u64>,
    /// The planner's prediction of `step_peak_bytes` ([`remat::plan`], from stage profiles at
    /// this batch, one stage at a time) and of the step time over `off`'s.
    #[serde(default)]
    pub predicted_peak_bytes: Option<u64>,
    #[serde(default)]
    pub predicted_time_ratio: Option<f64>,
    /// The segment starts a `budget=`/`auto` policy resolved to (`plan=...`), else empty.
    #[serde(default)]
    pub plan: String,
    /// `off` only (JSON only): the planner's memory/time frontier, the `budget=` plans for budgets
    /// from the least peak to `off`'s.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frontier: Vec<FrontierPoint>,
    /// The planner's whole estimate (JSON only): forward and backward peaks, what the peak is
    /// made of, recompute time.
    #[serde(default)]
    pub estimate: Option<Estimate>,
    /// Gradient and buffer elements whose bits differ from plain candle's.
    pub grads_differing: u64,
    pub max_abs_diff: f64,
    /// Parameters whose gradient is missing or all zero.
    pub params_without_grad: usize,
    pub status: Status,
    pub error: String,
    /// Data-parallel ranks the configuration ran on (MPI); byte and time figures are rank 0's.
    #[serde(default = "one")]
    pub ranks: usize,
    /// With several ranks: the optimizer state sharded over them (ZeRO stage 1).
    #[serde(default)]
    pub shard_optimizer: bool,
    /// With several ranks: the largest rank's `model_state_bytes` and `step_peak_bytes`, and the
    /// time per step in gradient all-reduce calls (median) and how long the training thread
    /// waited for the means (dividing by the ranks included).
    #[serde(default)]
    pub model_state_bytes_max_rank: Option<u64>,
    #[serde(default)]
    pub step_peak_bytes_max_rank: Option<u64>,
    #[serde(default)]
    pub all_reduce_ms: Option<f64>,
    #[serde(default)]
    pub all_reduce_wait_ms: Option<f64>,
    /// The harness command that measured this record (JSON only: the reports list the distinct
    /// ones, as a folder's records can come from several runs).
    #[serde(default)]
    pub command: String,
    /// Memory timeline of the first timed step (JSON only), and the heap when that step began.
    #[serde(default)]
    pub timeline: Vec<Event>,
    #[serde(default)]
    pub timeline_base_bytes: u64,
}

/// A plan on the planner's memory/time frontier, predicted.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FrontierPoint {
    pub plan: String,
    pub peak_bytes: u64,
    pub time_ratio: f64,
}

/// How a configuration ended: measured, out of memory (a result: it does not fit), or failed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Oom,
    #[default]
    Error,
    /// Not run: predicted to need more than the memory cap.
    Skipped,
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Status::Ok => "ok",
            Status::Oom => "oom",
            Status::Error => "error",
            Status::Skipped => "skipped",
        })
    }
}

/// A ratio measured over several rounds: median, range, every round's value.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub rounds: Vec<f64>,
}

impl Spread {
    pub fn of(mut rounds: Vec<f64>) -> Option<Spread> {
        rounds.retain(|r| r.is_finite());
        if rounds.is_empty() {
            return None;
        }
        let mut sorted = rounds.clone();
        sorted.sort_by(f64::total_cmp);
        Some(Spread { median: sorted[sorted.len() / 2], min: sorted[0], max: sorted[sorted.len() - 1], rounds })
    }
}

/// Records written before accumulation existed ran one micro-batch per step.
fn one() -> usize {
    1
}

/// Records written before the check could be skipped were all checked.
fn yes() -> bool {
    true
}

impl Record {
    pub fn new(w: &Workload, policy: &Policy, device: &str) -> Self {
        Record {
            model: w.model.clone(),
            policy: policy.to_string(),
            batch: w.batch,
            accumulate: w.accumulate,
            optimizer: w.optimizer().to_string(),
            input: w.input(),
            dtype: w.dtype.to_string(),
            device: device.to_string(),
            threads: candle_core::utils::get_num_threads(),
            ranks: 1,
            shard_optimizer: w.shard_optimizer,
            ..Default::default()
        }
    }
}

/// The planner's profile of `inst` at its batch, measured at that batch ([`Profile::at_batch`]).
pub fn profile(inst: &dyn Instance, seed: u64) -> Result<Profile> {
    Ok(Profile::at_batch(inst.graph(), |n| inst.inputs_at(0, n), &inst.store().vars(), inst.batch(), seed)?)
}

/// The predicted step of `policy` with `accumulate` micro-batches: the first micro-batch
/// gathers the parameter gradients, later ones hold them all from the start.
pub fn predict(profile: &Profile, policy: &Policy, accumulate: usize) -> Result<Estimate> {
    let first = profile.predict_policy(policy, 0)?;
    if accumulate == 1 {
        return Ok(first);
    }
    let later = profile.predict_policy(policy, profile.param_grad_bytes())?;
    Ok(if later.peak > first.peak { Estimate { recompute_ms: first.recompute_ms, step_ms: first.step_ms, ..later } } else { first })
}

/// Measures `policy` on `w`: a warm-up step, then `steps` timed steps (the record's status is
/// `ok`, its gradient fields still empty: see [`check`]); `steps == 0` predicts only (a dry run:
/// status `skipped`). With `predict_step` the planner profiles the model first and predicts the
/// step; a `budget=`/`auto` policy is resolved from a profile either way (`auto` takes `cap`, the
/// memory the run may use). The timing rounds, which keep only the step time, predict nothing.
#[allow(clippy::too_many_arguments)]
pub fn run(
    w: &Workload,
    policy: &Policy,
    steps: usize,
    seed: u64,
    device: &Device,
    device_name: &str,
    cap: Option<u64>,
    predict_step: bool,
    group: &trainkit::Group,
) -> Result<Record> {
    let mut rec = Record::new(w, policy, device_name);
    let counter = Counter::for_device(device);
    counter.synchronize();
    let base = counter.current();
    set_activity(Activity::Build, None);
    let inst = w.build(device, seed)?;
    let mut optimizer = inst.optimizer(w.shard_optimizer, group)?;
    let mut policy = policy.clone();
    if predict_step || policy.needs_plan() {
        let profile = profile(&*inst, seed)?;
        // After the profile: the workspaces kernels keep from their first calls are part of it.
        let inputs_bytes: u64 = inst.inputs(0)?.iter().map(remat::memory::tensor_bytes).sum();
        let fixed = trainkit::memory_before_step(device, &*optimizer, inputs_bytes)?;
        let held = if w.accumulate > 1 { profile.param_grad_bytes() } else { 0 };
        let (resolved, plan) = remat::plan::resolve(&policy, &profile, fixed, held, trainkit::auto_budget(device, cap))?;
        policy = trainkit::parallel::agreed_policy(group, &policy, resolved)?;
        if plan.is_some() {
            rec.plan = policy.to_string();
        }
        if predict_step {
            let estimate = predict(&profile, &policy, w.accumulate)?;
            if policy == Policy::Off {
                let points = remat::plan::frontier(&profile, fixed, held, 16);
                rec.frontier = points
                    .iter()
                    .map(|p| FrontierPoint { plan: p.policy().to_string(), peak_bytes: p.estimate.peak, time_ratio: p.estimate.time_ratio() })
                    .collect();
            }
            rec.predicted_peak_bytes = Some(estimate.peak);
            rec.predicted_time_ratio = Some(estimate.time_ratio());
            rec.estimate = Some(estimate);
        }
    }
    if steps == 0 {
        rec.status = Status::Skipped;
        rec.error = "dry run".into();
        return Ok(rec);
    }
    let exec = Executor::new(inst.graph(), &policy, inst.store().vars(), trainkit::rank_seed(seed, group.rank()))?;
    rec.segments = exec.segments().len();
    rec.ranks = group.world();
    // Every rank draws the global batch and keeps its rows (the ranks see it whole between them).
    let inputs = |n: u64| -> Result<Vec<candle_core::Tensor>> { Ok(group.shard(inst.inputs_at(n, inst.batch() * group.world())?)?) };
    let (mut comm_ms, mut wait_ms) = (Vec::new(), Vec::new());
    rec.segment_ranges = exec.segments().iter().map(|r| [r.start, r.end]).collect();
    let mut times = Vec::new();
    // f16 trains under dynamic loss scaling, as the trainers do.
    let mut scaler = (w.dtype == layers::Precision::F16).then(trainkit::LossScaler::default);
    let stepper = trainkit::Stepper { group, exec: &exec, accumulate: w.accumulate, batch_names: None };
    for step in 0..=steps as u64 {
        let comm_before = group.comm_time();
        let out = stepper.step(step, scaler.as_mut(), inputs, |grads| Ok(optimizer.update(grads)?))?;
        let comm = group.comm_time();
        if step == 0 {
            continue; // warm-up: first-touch page faults, lazily built kernels and caches
        }
        if !out.updated {
            rec.skipped_updates += 1;
        }
        let usage = out.usage;
        times.push(usage.elapsed_ms);
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
    rec.reserved_bytes = counter.reserved();
    if group.world() > 1 {
        let median = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        rec.all_reduce_ms = Some(median(comm_ms));
        rec.all_reduce_wait_ms = Some(median(wait_ms));
        rec.step_peak_bytes_max_rank = Some(group.min_max(rec.step_peak_bytes)?.1);
        rec.model_state_bytes_max_rank = Some(group.min_max(rec.model_state_bytes)?.1);
        trainkit::parallel::check_in_sync(group, inst.store())?;
    }
    times.sort_by(f64::total_cmp);
    rec.timed_steps = times.len();
    rec.step_ms_median = times[times.len() / 2];
    rec.step_ms_min = times[0];
    rec.step_ms_max = times[times.len() - 1];
    rec.status = Status::Ok;
    Ok(rec)
}

/// Checks `policy` on `w` against plain candle and fills the record's gradient fields (run it
/// after [`run`], once the model is freed and any memory cap lifted: the check builds two more
/// models). `replay_rng: false` makes the check's recomputes draw fresh dropout keys (see
/// `--no-rng-replay`): it exists only to show the check can fail.
pub fn check(rec: &mut Record, w: &Workload, policy: &Policy, seed: u64, device: &Device, replay_rng: bool) -> Result<()> {
    set_activity(Activity::GradCheck, None);
    let check = gradcheck(w, policy, seed, device, replay_rng)?;
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
fn executor_step(w: &Workload, policy: &Policy, seed: u64, device: &Device, replay_rng: bool) -> Result<(Fingerprint, usize)> {
    let inst = w.build(device, seed)?;
    let mut exec = Executor::new(inst.graph(), policy, inst.store().vars(), seed)?;
    if !replay_rng {
        exec = exec.without_rng_replay();
    }
    let out = exec.step(&inst.inputs(0)?, 0)?;
    Ok(((inst.store().grad_bits(&out.grads)?, inst.store().buffer_bits()?), inst.store().vars().len()))
}

/// One step in plain candle and one through the executor under `policy` (`off` included), on
/// identical weights, batch and seed: every gradient element and every buffer element compared
/// bit for bit; and every parameter must receive a non-zero gradient.
fn gradcheck(w: &Workload, policy: &Policy, seed: u64, device: &Device, replay_rng: bool) -> Result<GradCheck> {
    let (ref_grads, ref_bufs) = plain_step(w, seed, device)?;
    let ((grads, bufs), n_params) = executor_step(w, policy, seed, device, replay_rng)?;
    let zero = grads.values().filter(|g| g.iter().all(|&x| f32::from_bits(x) == 0.0)).count();
    let mut check = GradCheck { differing: 0, max_abs_diff: 0.0, without_grad: n_params - grads.len() + zero };
    let pairs = ref_grads.iter().map(|(n, a)| (a, grads.get(n))).chain(ref_bufs.iter().map(|(n, a)| (a, bufs.get(n))));
    for (a, b) in pairs {
        match b {
            Some(b) if a.len() == b.len() => {
                for (&x, &y) in a.iter().zip(b) {
                    if x != y {
                        check.differing += 1;
                        check.max_abs_diff = check.max_abs_diff.max((f32::from_bits(x) - f32::from_bits(y)).abs() as f64);
                    }
                }
            }
            Some(_) => return Err(anyhow!("tensor shapes differ between plain candle and {policy}")),
            None => check.differing += a.len() as u64,
        }
    }
    Ok(check)
}
