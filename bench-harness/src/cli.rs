//! The harness's command line: what every command shares ([`Common`]) and what the matrix adds
//! ([`MatrixArgs`]).

use crate::workloads::{self, Profile};
use clap::{Args, ValueEnum};
use remat::PolicyRequest;
use std::path::PathBuf;
use trainkit::DeviceName;

/// Which matrix to run (`--matrix`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MatrixKind {
    /// `models` and `depth`.
    All,
    /// Every model x every applicable policy of the profile.
    Models,
    /// Off and sqrt on ever deeper GPT-2 block stacks.
    Depth,
    /// Rewrite the reports from matrix.json; run nothing.
    Render,
    /// GPT-2 small to XL against 24 GiB.
    #[value(name = "gpt2-24gb")]
    Gpt2_24gb,
    /// Llama-family fine-tunes, 0.5B to 8B, against 24 GiB.
    #[value(name = "llm-24gb")]
    Llm24gb,
}

impl MatrixKind {
    /// The profile of a matrix that asks what fits 24 GiB, else `None`.
    pub fn fits_24gb(self) -> Option<Profile> {
        match self {
            MatrixKind::Gpt2_24gb => Some(Profile::Gpt2_24gb),
            MatrixKind::Llm24gb => Some(Profile::Llm24gb),
            _ => None,
        }
    }
}

/// Another framework run beside ours (`--baseline`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BaselineKind {
    /// PyTorch eager with torch.utils.checkpoint on the same segments.
    Pytorch,
    /// `pytorch`, and per model the whole step through torch.compile (inductor) at a sweep of
    /// activation memory budgets ([`crate::run::baseline::COMPILE_BUDGETS`]).
    PytorchCompile,
}

#[derive(Args, Clone)]
pub struct Common {
    /// Configuration set: smoke (tiny, seconds), cpu (minutes per model), full (the article's
    /// sizes).
    #[arg(long)]
    pub profile: Option<Profile>,
    /// Timed steps per configuration (after one warm-up step).
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: DeviceName,
    /// Override every selected model's batch size.
    #[arg(long)]
    pub batch: Option<usize>,
    /// Override every selected model's input size: sequence length, or image side.
    #[arg(long)]
    pub input_size: Option<usize>,
    /// Gradient accumulation: micro-batches of --batch per optimizer step; a timed step is all
    /// of them and the update (default: the profile's, 1 but in gpt2-24gb).
    #[arg(long)]
    pub accumulate: Option<usize>,
    /// Train every selected model with this optimizer (sgd, adamw, adafactor) instead of its
    /// default (SGD for the ResNets, AdamW for the others).
    #[arg(long)]
    pub optimizer: Option<trainable::OptimizerKind>,
    /// The dtype activations are computed in (f32, bf16, f16; parameters stay f32); default:
    /// the profile's, f32 but in gpt2-24gb. f16 runs with dynamic loss scaling.
    #[arg(long)]
    pub dtype: Option<trainable::Precision>,
    /// Emulate a smaller memory (e.g. 24GiB): on the CPU allocations beyond this much heap fail;
    /// on a GPU the rest of the device memory is held.
    #[arg(long, value_parser = remat::memory::parse_size)]
    pub memory_cap: Option<u64>,
    /// Data parallelism: every configuration runs on N ranks under mpirun (a build with
    /// `--features mpi`), each with its own batch (--batch is per rank) and its share of the
    /// cores; records the largest rank's step peak and the time in gradient all-reduces.
    /// Results go to results/<profile>-<device>-ranksN.
    #[arg(long, default_value_t = 1)]
    pub ranks: usize,
    /// Give freed memory back to the OS at once (mimalloc's purge delay 0) instead of keeping it
    /// for the next step: resident memory stays near the live heap, which near the machine's
    /// memory decides whether a run is killed, at the cost of page faults every step.
    #[arg(long)]
    pub return_freed_memory: bool,
    /// With --ranks: shard the optimizer state over the ranks (ZeRO stage 1): each keeps and
    /// updates its share. Results go to results/<profile>-<device>-ranksN-sharded.
    #[arg(long)]
    pub shard_optimizer: bool,
    /// Negative control: the gradient check's recomputes draw fresh dropout keys instead of
    /// replaying the forward's, so every policy that recomputes dropout must fail the check.
    /// Exists only to prove the check can fail (tests); never use it for results.
    #[arg(long, hide = true)]
    pub no_rng_replay: bool,
    /// The fused ops on the CPU: `kernel` (ours), or `generic`, the device-generic route a GPU
    /// takes, forced here to measure it without one. Results go to
    /// results/<profile>-<device>-generic.
    #[arg(long, value_enum, default_value_t = FusedPath::Kernel)]
    pub fused_path: FusedPath,
}

/// `--fused-path`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FusedPath {
    Kernel,
    Generic,
}

impl From<FusedPath> for ops::fused::Path {
    fn from(p: FusedPath) -> Self {
        match p {
            FusedPath::Kernel => ops::fused::Path::Kernel,
            FusedPath::Generic => ops::fused::Path::Generic,
        }
    }
}

#[derive(Args)]
pub struct MatrixArgs {
    /// Which matrix to run: `models` (every model x every applicable policy of the profile),
    /// `depth` (the depth sweep: off and sqrt on ever deeper GPT-2 block stacks), `all` (both),
    /// `gpt2-24gb` (GPT-2 small to XL at batch 1 with accumulation, in four precision/optimizer
    /// variants, predicted and measured against 24 GiB), `llm-24gb` (the same of Llama-family
    /// models from Qwen2.5-0.5B to Llama-3.1-8B at seq 2048 and 4096, fully fine-tuned or with
    /// LoRA over a bf16 base), or `render` (rewrite the CSV, Markdown,
    /// TABLE.md and plots from matrix.json; run nothing).
    #[arg(long, value_enum, default_value_t = MatrixKind::All)]
    pub matrix: MatrixKind,
    /// Only these models (comma-separated): a model's whole name selects it alone, another name
    /// every model whose name starts with it, e.g. gpt2,resnet50.
    #[arg(long, value_delimiter = ',')]
    pub models: Vec<String>,
    /// Only these policies (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<PolicyRequest>,
    /// Results folder; default results/<profile>-<device>.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Rerun configurations that already have a result.
    #[arg(long)]
    pub force: bool,
    /// Extra timing rounds per model after its configurations: every policy again, interleaved
    /// (off, sqrt, ..., off, sqrt, ...), each in a fresh process; each policy's time / off is then
    /// reported as the median and range over this run's ratio and the rounds'.
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Take the times again and nothing else: for every selected model whose `off` the folder
    /// holds, `--rounds` interleaved timing rounds of its measured policies (PyTorch beside with
    /// `--baseline`), whose times replace the measuring run's. For a folder measured while the
    /// machine was busy: memory does not depend on load, times do.
    #[arg(long, conflicts_with = "force")]
    pub retime: bool,
    /// Also run each configuration in another framework, side by side: `pytorch` runs
    /// scripts/torch_baseline.py (PyTorch eager, torch.utils.checkpoint on the same segments);
    /// `pytorch-compile` that, and after each model's configurations its step compiled by
    /// torch.compile at activation memory budgets from 1.0 to 0.1 (compile time apart).
    #[arg(long, value_enum)]
    pub baseline: Option<BaselineKind>,
    /// The Python that has torch, torchvision and transformers, for --baseline pytorch (which it
    /// needs; default python3).
    #[arg(long)]
    pub python: Option<String>,
    /// Predict every configuration and run none: the planner's step peak (forward and backward,
    /// and what it is made of) and time, printed, nothing saved. gpt2-24gb and llm-24gb: every
    /// configuration predicted at its size and recorded as not run.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub common: Common,
}

impl MatrixArgs {
    /// Whether each model's step is also run compiled (`--baseline pytorch-compile`).
    pub fn compiled(&self) -> bool {
        self.baseline == Some(BaselineKind::PytorchCompile)
    }

    /// The Python of `--baseline pytorch`: `--python`, else `python3`.
    pub fn python(&self) -> &str {
        self.python.as_deref().unwrap_or("python3")
    }
}

impl Common {
    /// What the flags change in every selected workload.
    pub fn overrides(&self) -> workloads::Overrides {
        workloads::Overrides {
            batch: self.batch,
            input_size: self.input_size,
            accumulate: self.accumulate,
            optimizer: self.optimizer,
            dtype: self.dtype,
            shard_optimizer: self.shard_optimizer,
        }
    }

    /// The default results folder: `results/<profile>-<device>`, `-ranksN` with data parallelism
    /// (`-ranksN-sharded` with the optimizer state sharded).
    pub fn results_dir(&self, profile: Profile) -> PathBuf {
        let sharded = if self.shard_optimizer { "-sharded" } else { "" };
        let ranks =
            if self.ranks > 1 { format!("-ranks{}{sharded}", self.ranks) } else { String::new() };
        let generic = if self.fused_path == FusedPath::Generic { "-generic" } else { "" };
        PathBuf::from(format!(
            "results/{profile}-{}{ranks}{generic}",
            self.device.to_string().replace(':', "")
        ))
    }

    /// The profile that fits the device unless one was named.
    pub fn profile(&self) -> Profile {
        self.profile.unwrap_or(if self.device == DeviceName::Cpu {
            Profile::Cpu
        } else {
            Profile::Full
        })
    }
}
