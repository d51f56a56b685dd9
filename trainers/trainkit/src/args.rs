//! The flags every trainer shares ([`RunArgs`]), each trainer's defaults for them ([`main`]),
//! and the checks that refuse bad values before anything starts: counts, the learning rate, the
//! loss scale, the device.

use anyhow::{bail, Context, Result};
use candle_core::Device;
use remat::PolicyRequest;
use trainable::OptimizerKind;

/// A trainer's defaults for the shared flags that have no one default for every model: the policy
/// that suits its architecture, and the steps, batch, optimizer and learning rate it trains well
/// with.
pub struct Defaults {
    pub policy: PolicyRequest,
    pub steps: usize,
    pub batch: usize,
    pub optimizer: OptimizerKind,
    pub lr: f64,
}

/// Parses the command line into a trainer's arguments `A` (which flatten [`RunArgs`]), with the
/// trainer's `defaults`; on a bad or missing flag prints clap's error and exits, as
/// `Parser::parse` does.
pub(crate) fn parse<A: clap::Parser>(defaults: Defaults) -> A {
    let values = [
        ("policy", defaults.policy.to_string()),
        ("steps", defaults.steps.to_string()),
        ("batch", defaults.batch.to_string()),
        ("optimizer", defaults.optimizer.to_string()),
        ("lr", defaults.lr.to_string()),
    ];
    let command = values.into_iter().fold(A::command(), |c, (id, value)| {
        c.mut_arg(id, |a| a.default_value(value).required(false))
    });
    let matches = command.try_get_matches().unwrap_or_else(|e| match e.kind() {
        // Printed as every line a run says: clap's own printing ignores a failed write, and
        // `--help > /dev/full` exited 0 having printed nothing.
        clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => {
            let text = e.render().to_string();
            crate::say_line(crate::Stream::Stdout, format_args!("{}", text.trim_end()));
            std::process::exit(0)
        }
        _ => e.exit(),
    });
    A::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// The command-line options every trainer shares.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Checkpointing policy: off, sqrt, every-two-blocks, before-downsample (ResNet, U-Net),
    /// every-n=K, explicit=I,J,..., budget=SIZE (the plan with the least recompute that fits
    /// SIZE, model state included), auto; `+keep=OPS` keeps those ops' outputs inside the
    /// recomputed segments.
    #[arg(long)]
    pub policy: PolicyRequest,
    /// Optimizer steps to train.
    #[arg(long)]
    pub steps: usize,
    /// Samples per batch (on each rank; per micro-batch with --accumulate).
    #[arg(long)]
    pub batch: usize,
    /// sgd, adamw or adafactor.
    #[arg(long)]
    pub optimizer: OptimizerKind,
    #[arg(long)]
    pub lr: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// cpu, cuda or cuda:N (CUDA needs a build with --features cuda).
    #[arg(long, default_value = "cpu")]
    pub device: DeviceName,
    /// Write one JSON record per step to this file.
    #[arg(long)]
    pub log_json: Option<std::path::PathBuf>,
    /// Write the trained weights (and BatchNorm statistics) here as a safetensors snapshot.
    #[arg(long)]
    pub save: Option<std::path::PathBuf>,
    /// Also write the snapshot every N steps, with a training snapshot beside it
    /// (`<save>.train.safetensors`: weights, optimizer state, next step) that `--resume` continues.
    #[arg(long, requires = "save")]
    pub save_every: Option<usize>,
    /// Continue an interrupted run from its training snapshot: the losses and final weights are
    /// those of an uninterrupted run, bit for bit (same flags and --seed); --log-json appends.
    #[arg(long)]
    pub resume: Option<std::path::PathBuf>,
    /// Every N steps and after the last, print (and log) the loss in evaluation mode (no dropout,
    /// BatchNorm on its running statistics) on --eval-batches batches of the data steps after the
    /// last training step (of a fixed data set, drawn from the samples training draws from).
    #[arg(long)]
    pub eval_every: Option<usize>,
    #[arg(long, default_value_t = 2, requires = "eval_every")]
    pub eval_batches: usize,
    /// Gradient accumulation: N micro-batches of --batch per optimizer step (effective batch
    /// N x --batch); the gradient is the mean of the micro-batch gradients.
    #[arg(long, default_value_t = 1)]
    pub accumulate: usize,
    /// The dtype activations are computed and stored in: f32, bf16 or f16 (parameters, their
    /// gradients and the optimizer state stay f32), or bf16-weights (parameters and gradients
    /// bf16 too, optimizer moments f32).
    #[arg(long, default_value = "f32")]
    pub dtype: trainable::Precision,
    /// Parameters that do not train, by name (`*`: any run of characters), comma-separated:
    /// `h.*.attn.*,wte.weight` (GPT-2), `bert.embeddings.*` (BERT), `conv1.*,bn1.*,layer1.*`
    /// (ResNet), `enc.0.*` (U-Net). They get no gradient, neither computed nor stored, and no
    /// optimizer state; snapshots still hold them.
    #[arg(long)]
    pub freeze: Option<params::Freeze>,
    /// f16 only: the initial loss scale (default 65536). A step whose gradients are not finite is
    /// skipped and the scale halved; after 2000 good steps in a row it doubles (PyTorch's
    /// GradScaler).
    #[arg(long)]
    pub loss_scale: Option<f64>,
    /// Predict the run's memory (per phase, for this policy and the fixed ones) and step time
    /// from a profile of the model's stages (one at a time), print it, and train nothing (so
    /// nothing to save, resume or log).
    #[arg(long, conflicts_with_all = ["save", "resume", "log_json"])]
    pub dry_run: bool,
    /// The memory the run may use, e.g. 8GiB: on the CPU allocations beyond it fail (an emulated
    /// smaller device), and `--policy auto` plans for it (without it, `auto` plans for the
    /// device's free memory less a tenth).
    #[arg(long, value_parser = remat::memory::parse_size)]
    pub memory_cap: Option<u64>,
    /// Data parallelism over N processes on this machine: re-runs this command under
    /// `mpirun -np N` (a build with `--features mpi`), each rank bound to its own cores and
    /// training on its shard of every batch (--batch is per rank). Already under mpirun, the
    /// ranks are mpirun's.
    #[arg(long, default_value_t = 1)]
    pub ranks: usize,
    /// With several ranks: ZeRO stage 1. Each rank keeps and updates the optimizer state of its
    /// share of the parameters only, then sends those parameters to the others; training
    /// snapshots gather the whole state on rank 0.
    #[arg(long)]
    pub shard_optimizer: bool,
    /// The optimizer inside backward: each segment's parameters are updated as soon as backward
    /// has made their gradients final, and those gradients freed, so a step never holds every
    /// gradient at once. The weights equal the ordinary step's bit for bit (each parameter's
    /// update reads its own gradient and state only). One micro-batch per step on one rank
    /// without f16 loss scaling: each of those needs every gradient before any update.
    #[arg(long)]
    pub optimizer_in_backward: bool,
}

/// The most batches an evaluation runs (`--eval-batches`): each is a forward pass, so
/// more would run for days without a word.
const MAX_EVAL_BATCHES: usize = 10_000;

/// The most classes a classifier takes (`--classes`): far beyond any classifier (ImageNet-21k has
/// 21,841), and low enough that every size computed from it fits a count; a count near 2^64
/// overflowed the allocation of the synthetic labels and panicked. Below it, a classifier too
/// large for the machine is refused while it is built.
pub const MAX_CLASSES: usize = 1 << 40;

/// Refuses `--classes` beyond [`MAX_CLASSES`].
pub fn check_classes(classes: usize) -> Result<()> {
    if classes > MAX_CLASSES {
        bail!("--classes {classes} is more than {MAX_CLASSES}");
    }
    Ok(())
}

/// Refuses a `--batch` at which a BatchNorm sees one value per channel (the batch times the
/// `positions` of the model's smallest feature map, `map` in words): it normalizes that value to its bias alone,
/// whatever the input, so nothing before it learns (the step-0 loss is ln(classes) and only the
/// classifier's bias moves). PyTorch refuses it too: "expected more than 1 value per channel
/// when training".
pub fn check_batch_norm(batch: usize, positions: usize, map: &str) -> Result<()> {
    if batch.saturating_mul(positions) <= 1 {
        bail!(
            "--batch {batch} is too small for BatchNorm: the smallest feature map is {map} per \
             sample, so a BatchNorm there sees one value per channel, which it normalizes to its \
             bias alone, and nothing before it learns (PyTorch refuses it too); use --batch 2 \
             or more"
        );
    }
    Ok(())
}

/// The most micro-batches an optimizer step accumulates (`--accumulate`): each is a forward and
/// a backward pass, so more would run for days without a word.
pub const MAX_ACCUMULATE: usize = 1_000_000;

/// Refuses an `--accumulate` beyond [`MAX_ACCUMULATE`], or one whose effective batch (`batch`
/// samples per micro-batch, over all ranks) would not fit a count: it wrapped to "effective
/// batch 0" and a step that never ended.
pub fn check_accumulate(accumulate: usize, batch: usize) -> Result<()> {
    if accumulate > MAX_ACCUMULATE {
        bail!("--accumulate {accumulate} is more than {MAX_ACCUMULATE} (each is a forward and backward pass)");
    }
    // One micro-batch is the step's own size, refused with its footprint where it cannot fit.
    if accumulate > 1 && accumulate.checked_mul(batch).is_none_or(|n| n > u32::MAX as usize) {
        bail!("--accumulate {accumulate} x --batch {batch}: an effective batch too large to count");
    }
    Ok(())
}

impl RunArgs {
    /// Refuses values the run could only ignore or misuse, before anything starts: a learning rate
    /// that is not a positive finite number (NaN or infinity would train to garbage without a
    /// word), counts of 0 (`--save-every 0` never saved, `--eval-every 0` and `--eval-batches 0`
    /// never evaluated),
    /// `--eval-batches` beyond [`MAX_EVAL_BATCHES`], a loss scale f32 cannot hold.
    pub fn check(&self) -> Result<()> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            bail!("--lr {} is not a positive finite number", self.lr);
        }
        let positive = [
            ("--steps", Some(self.steps)),
            ("--batch", Some(self.batch)),
            ("--save-every", self.save_every),
            ("--eval-every", self.eval_every),
            ("--eval-batches", Some(self.eval_batches)),
            ("--ranks", Some(self.ranks)),
            ("--accumulate", Some(self.accumulate)),
        ];
        for (flag, value) in positive {
            if value == Some(0) {
                bail!("{flag} must be at least 1");
            }
        }
        check_accumulate(self.accumulate, self.batch.saturating_mul(self.ranks))?;
        if self.eval_batches > MAX_EVAL_BATCHES {
            bail!(
                "--eval-batches {} is more than {MAX_EVAL_BATCHES} (each is a forward pass)",
                self.eval_batches
            );
        }
        if self.optimizer_in_backward {
            let conflict = [
                (
                    self.accumulate > 1,
                    "--accumulate above 1 (a gradient is final only after the last micro-batch's \
                     backward)",
                ),
                (
                    self.ranks > 1,
                    "--ranks above 1 (the gradients are averaged over the ranks before the update)",
                ),
                (
                    self.dtype == trainable::Precision::F16,
                    "--dtype f16 (its loss scaler skips a step unless every gradient is finite)",
                ),
            ];
            if let Some((_, why)) = conflict.iter().find(|(c, _)| *c) {
                bail!(
                    "--optimizer-in-backward updates each parameter as its gradient is final: not \
                     with {why}"
                );
            }
        }
        if let Some(scale) = self.loss_scale {
            if self.dtype != trainable::Precision::F16 {
                bail!("--loss-scale applies to --dtype f16 only (this run: {})", self.dtype);
            }
            if !(scale.is_finite() && scale > 0.0 && scale <= f32::MAX as f64) {
                bail!(
                    "--loss-scale {scale} is not a positive number f32 can hold (at most {:e}): \
                     every step would overflow and be skipped",
                    f32::MAX
                );
            }
            if scale < 1.0 {
                bail!(
                    "--loss-scale {scale:e} is below 1: it would push the gradients further under \
                     f16's smallest number (6e-8), which loss scaling exists to lift them above \
                     (the scaler lowers the scale itself when a step overflows)"
                );
            }
        }
        Ok(())
    }
}

/// The device a run is on (`--device`): `cpu`, `cuda` (this rank's GPU: under one process per
/// GPU, the `LOCAL_RANK`-th) or `cuda:N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceName {
    Cpu,
    Cuda(Option<usize>),
}

impl std::str::FromStr for DeviceName {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(DeviceName::Cpu),
            "cuda" => Ok(DeviceName::Cuda(None)),
            d => match d.strip_prefix("cuda:") {
                Some(n) => {
                    Ok(DeviceName::Cuda(Some(n.parse().context("--device cuda:N needs a number")?)))
                }
                None => bail!("unknown device `{d}`; valid devices: cpu, cuda, cuda:N"),
            },
        }
    }
}

impl std::fmt::Display for DeviceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceName::Cpu => write!(f, "cpu"),
            DeviceName::Cuda(None) => write!(f, "cuda"),
            DeviceName::Cuda(Some(n)) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceName {
    pub fn is_cuda(self) -> bool {
        matches!(self, DeviceName::Cuda(_))
    }

    /// The device itself; a clear error when this build has no CUDA support.
    pub fn open(self) -> Result<Device> {
        let DeviceName::Cuda(ordinal) = self else { return Ok(Device::Cpu) };
        if !candle_core::utils::cuda_is_available() {
            bail!("--device {self}: this build has no CUDA support (build with --features cuda)");
        }
        let local = || std::env::var("LOCAL_RANK").ok().and_then(|r| r.parse().ok()).unwrap_or(0);
        Ok(Device::new_cuda(ordinal.unwrap_or_else(local))?)
    }
}
