//! What a results folder holds, as data: one record per measured configuration ([`Record`]), the
//! gpt2-24gb prediction beside it ([`Prediction`]) and the article's configurations projected at
//! full size ([`Projection`]), and PyTorch's row beside ours ([`Baseline`]). Measuring, predicting
//! and rendering them are other modules' jobs; this one depends on none of them.

use crate::workloads::Workload;
use remat::memory::Event;
use remat::plan::Estimate;
use remat::PolicyRequest;
use serde::{Deserialize, Serialize};

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
    /// `generic` where the fused ops took the device-generic route on the CPU (`--fused-path`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub fused_path: String,
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
    /// Minor page faults per timed step, the median (pages first touched in the step: a steady
    /// state takes none); absent where the OS does not count them.
    #[serde(default)]
    pub minor_faults_per_step: Option<u64>,
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
    /// Every gradient and buffer element equals plain candle's bit for bit (see
    /// [`crate::measure::one::check`]).
    pub grads_bit_identical: bool,
    /// Whether the gradient check ran (`gpt2-24gb` skips it where it would need more memory than
    /// the machine has: two models and a copy of every gradient).
    #[serde(default = "yes")]
    pub grads_checked: bool,
    /// Why the gradient check was skipped where the harness decided it does not fit (two steps
    /// of `off`'s predicted size beyond what the machine can give), else empty.
    #[serde(default)]
    pub check_skipped: String,
    /// `gpt2-24gb`: what the configuration was predicted to need
    /// ([`crate::run::fits_24gb::predict`]), and its total (the state, the gradients and the
    /// activations at the step's peak).
    #[serde(default)]
    pub predicted: Option<Prediction>,
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
    /// The commit of the harness that measured it (empty in records from before rows named it).
    #[serde(default)]
    pub commit: String,
    /// The command that took the times again (`--retime`), replacing the measuring run's; empty
    /// where the times are the measuring run's.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub times_command: String,
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
        let n = sorted.len();
        // Of an even count, the mean of the middle two.
        let median =
            if n % 2 == 1 { sorted[n / 2] } else { (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0 };
        Some(Spread { median, min: sorted[0], max: sorted[n - 1], rounds })
    }
}

#[cfg(test)]
mod tests {
    use super::Spread;

    /// The median of an odd count is the middle value, of an even count the mean of the middle
    /// two (two timing rounds: not the larger of the two); non-finite rounds are left out.
    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        let median = |v: &[f64]| Spread::of(v.to_vec()).map(|s| s.median);
        assert_eq!(median(&[1.87, 1.88]), Some((1.87 + 1.88) / 2.0));
        assert_eq!(median(&[2.90, 1.81]), Some((1.81 + 2.90) / 2.0));
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[1.0, f64::NAN, 3.0]), Some(2.0));
        assert_eq!(median(&[f64::NAN]), None);
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
    pub fn new(w: &Workload, policy: &PolicyRequest, device: &str) -> Self {
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

    /// The record of a configuration that was not run, with why: status `skipped`.
    pub fn skipped(mut self, reason: String) -> Self {
        self.status = Status::Skipped;
        self.error = reason;
        self
    }

    /// Everything the step held at its peak, measured: the state before it (parameters,
    /// optimizer state, inputs) and the step's peak above that (gradients, activations,
    /// temporaries).
    pub fn measured_total(&self) -> u64 {
        self.model_state_bytes + self.step_peak_bytes
    }

    /// The model state: the prediction's arithmetic ([`Prediction::state`]) where the record has
    /// one, else the measured state.
    pub fn state_bytes(&self) -> u64 {
        self.predicted.map_or(self.model_state_bytes, |p| p.state())
    }
}

/// Predicted bytes of one configuration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
    /// The planner's peak less the state: activations, temporaries and the inputs; `None` where
    /// no plan was found for the policy (a budget below what any plan needs), or in records from
    /// before predictions came from the planner, for the calibrating gpt2-small.
    pub activations: Option<u64>,
}

impl Prediction {
    /// The parameters, their gradients and the optimizer's state.
    pub fn state(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }

    /// Everything at the step's peak: the state, the gradients and the activations.
    pub fn total(&self) -> Option<u64> {
        Some(self.state() + self.activations?)
    }
}

/// One model at the article's size, predicted.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Projection {
    pub model: String,
    pub batch: usize,
    pub input: String,
    pub optimizer: String,
    pub dtype: String,
    /// Parameters, buffers, optimizer state and one batch of inputs: the heap before a step.
    pub state_bytes: u64,
    pub rows: Vec<ProjectedPolicy>,
    /// The harness command that made it.
    #[serde(default)]
    pub command: String,
}

/// One policy or plan of a projection.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProjectedPolicy {
    /// The policy as named (`sqrt`), or what a plan is for (`budget = sqrt's memory`).
    pub label: String,
    /// The segment starts of a plan (`plan=...`), else empty.
    pub plan: String,
    /// The step's predicted peak above the state, and the state plus it.
    pub peak_bytes: u64,
    pub total_bytes: u64,
    /// Predicted step time over `off`'s (from the profile's stage times on this machine).
    pub time_ratio: f64,
}

/// One PyTorch row, as the script prints it (plus status and error where it failed).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Baseline {
    /// The harness command that ran it (with `--baseline pytorch`).
    #[serde(default)]
    pub command: String,
    /// The commit of the harness (and so of the script) that ran it.
    #[serde(default)]
    pub commit: String,
    /// As [`Record::times_command`].
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub times_command: String,
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
    /// The FLOPs of one step's forward and backward without recompute, as PyTorch's
    /// `FlopCounterMode` counts them from the shapes of its products and convolutions (the same
    /// model and sizes as ours, so the same count serves both sides' GFLOP/s, under every policy).
    /// Counted in the `off` run only (older folders have it in every row).
    #[serde(default)]
    pub step_flops: Option<u64>,
    /// torch.mm's best rate on this machine in GFLOP/s (a 2048^3 f32 product, as
    /// [`super::results::Meta::matmul_peak_gflops`] measures ours); the `off` run only.
    #[serde(default)]
    pub mm_peak_gflops: Option<f64>,
    /// Our step time over PyTorch's, per interleaved pair (the measuring runs, then each timing
    /// round: ours, then PyTorch's, policy by policy): a host's drift shows as a spread. For a
    /// compiled run (`pytorch-compile`), "ours" is our fastest configuration of the model whose
    /// step peak is at most the compiled step's (timed in the same rounds, before it).
    #[serde(default)]
    pub ours_over_torch: Option<Spread>,
    /// PyTorch's step time over its `off`, per round, as our records' `time_vs_off`.
    #[serde(default)]
    pub time_vs_off: Option<Spread>,
    /// Compiled (`pytorch-compile`): the first step's time beyond a step's, in milliseconds:
    /// compiling the forward and backward graphs (left out of the step time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compile_ms: Option<f64>,
    /// Compiled: `torch._functorch.config.activation_memory_budget`, the share of the
    /// activations its backward may keep (1 keeps what the partitioner would; lower recomputes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_budget: Option<f64>,
    #[serde(default = "ok")]
    pub status: Status,
    #[serde(default)]
    pub error: String,
}

/// Baselines written before they had a status all ran.
fn ok() -> Status {
    Status::Ok
}
