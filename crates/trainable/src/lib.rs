//! `trainable`: what makes a model trainable and measurable here. The one interface every model
//! crate implements ([`Model`]), so that the trainers and the harness treat models alike (the
//! stage graph, the parameters, snapshots under the published names, evaluation), what the bench
//! harness needs to run a model ([`Benchable`]), what a run's shared flags set in a model's
//! configuration ([`ModelConfig`]), and the choices a run names on its command line: the
//! [`Precision`] it computes in, the [`OptimizerKind`] it trains with, a model's presets
//! ([`UnknownPreset`]) and configuration file ([`read_config`], its field checks in [`check`]).
//!
//! Not here: the layers models are built from (`ops`), their parameters (`params`), the
//! optimizers themselves (`optim`), the models (the trainer crates).

/// `FromStr`, `Display` and `Serialize` (as its name) for a choice named on the command line
/// (`--dtype`, `--optimizer`), from one table of names: an unknown name is refused with "unknown
/// <what> `x`; valid <what>s: ...".
macro_rules! named_choice {
    ($ty:ty, $what:literal, [$($variant:path => $name:literal),+ $(,)?]) => {
        impl std::str::FromStr for $ty {
            type Err = String;

            fn from_str(s: &str) -> std::result::Result<Self, String> {
                match s {
                    $($name => Ok($variant),)+
                    _ => Err(format!(concat!("unknown ", $what, " `{}`; valid ", $what, "s: \
                        {}"), s, [$($name),+].join(", "))),
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(match self {
                    $($variant => $name,)+
                })
            }
        }

        /// As its name: a run's configuration names it as its flag does.
        impl serde::Serialize for $ty {
            fn serialize<S: serde::Serializer>(
                &self,
                serializer: S,
            ) -> std::result::Result<S::Ok, S::Error> {
                serializer.collect_str(self)
            }
        }
    };
}

mod config;
mod precision;

pub use config::{check, read_config, ConfigError, ModelConfig, UnknownPreset};
pub use precision::Precision;

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::Optimizer;
use optim::{
    Adafactor, AdamW, ParamsAdafactor, ParamsAdamW, ParamsSgd, SgdMomentum, TrainOptimizer,
};
use params::{Initialised, ParamStore, SnapshotError};
use remat::StageGraph;
use std::path::Path;

/// What the trainers and the harness need of a model.
pub trait Model {
    /// The kinds of op it runs whose outputs a policy may keep (`+keep=`).
    const KEEPABLE: &'static [remat::keep::OpKind];

    /// Refuses a `policy` whose `+keep=` names an op this model does not run: it would keep
    /// nothing there and recompute all of it. The trainers and the harness both ask this.
    fn check_keep(policy: &remat::Policy) -> std::result::Result<(), String> {
        let keep = policy.keeps();
        let missing: Vec<String> = keep
            .kinds()
            .filter(|k| !Self::KEEPABLE.contains(k))
            .map(|k| k.name().to_string())
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let runs: Vec<&str> = Self::KEEPABLE.iter().map(|k| k.name()).collect();
        Err(format!(
            "{policy}: this model runs no {} op to keep (it keeps: {})",
            missing.join(" or "),
            runs.join(", ")
        ))
    }

    /// What a model is to the trainers: its stage graph and its parameters.
    fn parts(&self) -> (&StageGraph, &ParamStore);

    /// The stage graph the executor runs (inputs: the batch; output: the loss).
    fn graph(&self) -> &StageGraph {
        self.parts().0
    }

    /// Parameters and buffers, under the names published checkpoints use.
    fn params(&self) -> &ParamStore {
        self.parts().1
    }

    /// The name of ours that a published snapshot's tensor `name` loads into, or `None` to skip it
    /// (tied copies, counters, heads the model lacks). Default: the same name.
    fn snapshot_name(&self, name: &str) -> Option<String> {
        Some(name.to_string())
    }

    /// The published model's name for our parameter `name` (the inverse of
    /// [`Model::snapshot_name`]): what PEFT's adapter files are keyed by. Default: the same name.
    fn published_name(&self, name: &str) -> String {
        name.to_string()
    }

    /// Loads a LoRA adapter folder (PEFT's layout: `lora::save_adapter`'s or PEFT's own) into
    /// the model's adapters, PEFT's names mapped to ours by [`Model::snapshot_name`].
    fn load_adapter(&self, dir: &Path) -> std::result::Result<(), SnapshotError> {
        params::lora::load_adapter(dir, self.params(), |n| self.snapshot_name(n))
    }

    /// Writes every parameter and buffer as a safetensors snapshot.
    fn save_snapshot(&self, path: &Path) -> std::result::Result<(), SnapshotError> {
        self.params().save(path)
    }

    /// The loss on `inputs` (the graph's inputs) in evaluation mode: no dropout, BatchNorm on its
    /// running statistics, nothing updated ([`StageGraph::eval_loss`]).
    fn evaluate(&self, inputs: &[Tensor]) -> Result<f32> {
        self.graph().eval_loss(inputs)?.to_dtype(DType::F32)?.to_scalar::<f32>()
    }

    /// Whether parameter `name` belongs to the task head, which pre-trained snapshots may lack
    /// (a bare BERT encoder has no masked-LM head) or have for another task (a classifier's
    /// 1000 classes): [`Model::init_from`] keeps such a parameter's initial value. Default: none.
    fn task_head(&self, name: &str) -> bool {
        let _ = name;
        false
    }

    /// Loads a snapshot written by [`Model::save_snapshot`] or published in the model's format;
    /// every parameter and buffer must be found.
    fn load_snapshot(&self, path: &Path) -> std::result::Result<(), SnapshotError> {
        self.params().load(path, |name| self.snapshot_name(name), |_| false).map(drop)
    }

    /// Starts from pre-trained weights: [`Model::load_snapshot`], except that task-head
    /// parameters ([`Model::task_head`]) the snapshot lacks or has at another shape keep their
    /// initial values (returned, for the log), unless `strict`.
    /// LoRA adapters, which no base model's weights hold, keep theirs too (and are not returned);
    /// adapters the snapshot holds and the model has not are refused
    /// ([`SnapshotError::Adapters`]): a LoRA run's training is in them; so are adapters of
    /// another rank or scale ([`SnapshotError::AdapterConfig`]).
    fn init_from(
        &self,
        path: &Path,
        strict: bool,
    ) -> std::result::Result<Vec<Initialised>, SnapshotError> {
        let adapter = params::lora::is_adapter;
        let (tensors, metadata) = params::read_snapshot(path, self.params().device())?;
        let p = path.display().to_string();
        let renamed: std::collections::HashMap<String, candle_core::Tensor> =
            tensors.iter().filter_map(|(n, t)| Some((self.snapshot_name(n)?, t.clone()))).collect();
        self.params().check_adapters(&renamed, &metadata, &p)?;
        let ours: std::collections::HashSet<&str> =
            self.params().all().map(|(n, _)| n.as_str()).collect();
        // An adapter of one of this model's layers that the model gives no adapter.
        let dropped_adapter = |m: &str| {
            params::lora::adapted_layer(m)
                .is_some_and(|layer| ours.contains(format!("{layer}.weight").as_str()))
                && !ours.contains(m)
        };
        let dropped: Vec<&String> = tensors
            .keys()
            .filter(|n| self.snapshot_name(n).is_some_and(|m| dropped_adapter(&m)))
            .collect();
        if let Some(first) = dropped.iter().min() {
            let (count, first) = (dropped.len(), first.to_string());
            return Err(SnapshotError::Adapters { path: p, count, first });
        }
        let fresh = self.params().load_tensors(
            tensors,
            &p,
            |name| self.snapshot_name(name),
            |name| adapter(name) || (!strict && self.task_head(name)),
        )?;
        Ok(fresh.into_iter().filter(|i| !adapter(&i.name)).collect())
    }
}

/// A model the bench harness can run at any batch and input size on synthetic data: implementing
/// this in a model's crate, and naming the model in the harness's profiles, adds it to the matrix.
pub trait Benchable: Model + Sized + 'static {
    /// The architecture's configuration (a published preset's or a custom one).
    type Config: ModelConfig;
    /// A deterministic source of synthetic batches, built once per run.
    type Data: 'static;
    /// Whether some stages reduce the spatial size, so that `before-downsample` applies.
    const DOWNSAMPLES: bool;
    /// The optimizer its benchmarks train with (at [`OptimizerKind::bench_lr`]).
    const OPTIMIZER: OptimizerKind = OptimizerKind::Adamw;

    /// The input size in words: `seq 256`, `128x128`, `32^3`.
    fn describe_input(size: usize) -> String;

    fn build(config: &Self::Config, device: &Device, seed: u64) -> Result<Self>;

    /// A tensor every training step of `batch` inputs of size `size` holds, whatever the policy:
    /// what it is ("the logits") and its elements (`None` beyond u128). A lower bound of a step's
    /// need, so that a batch no machine here could hold is refused before anything is built, by
    /// the trainers and the harness alike (`trainkit::check_footprint`).
    fn step_floor(config: &Self::Config, batch: usize, size: usize)
        -> (&'static str, Option<u128>);

    /// `config` computing in `dtype`.
    fn with_dtype(config: &Self::Config, dtype: Precision) -> Self::Config {
        let mut config = config.clone();
        config.set_precision(dtype);
        config
    }

    /// The shapes of the model's own parameters (under LoRA its base, frozen, without the
    /// adapters: [`Benchable::adapter_shapes`]), in no particular order. By default from a model
    /// built on the CPU; a model too big for that derives them from its configuration.
    fn parameter_shapes(config: &Self::Config) -> Result<Vec<Vec<usize>>> {
        built_shapes::<Self>(config, |name| !params::lora::is_adapter(name))
    }

    /// The shapes of the LoRA adapters of a model of `config` (none without LoRA), in no
    /// particular order: the parameters that train under LoRA. By default from a model built on
    /// the CPU; a model too big for that derives them from its configuration.
    fn adapter_shapes(config: &Self::Config) -> Result<Vec<Vec<usize>>> {
        built_shapes::<Self>(config, params::lora::is_adapter)
    }

    /// A model of `config` with only `blocks` of its repeated blocks, and how many it has: a
    /// projection profiles the shallow model and deepens its profile
    /// (`remat::plan::Profile::deepened`) where the whole model's weights would not fit in
    /// memory. `None` for a model that is not one run of alike blocks.
    fn shallow(_config: &Self::Config, _blocks: usize) -> Option<(Self::Config, usize)> {
        None
    }

    /// The synthetic data for inputs of size `size` (sequence length, image or volume side).
    fn synthetic_data(&self, size: usize, seed: u64) -> Result<Self::Data>;

    /// The graph inputs of batch `step`: `batch` samples of `data`, the same for every policy.
    fn synthetic_inputs(
        &self,
        data: &Self::Data,
        step: u64,
        batch: usize,
        device: &Device,
    ) -> Result<Vec<Tensor>>;
}

/// The shapes of the parameters (trained or frozen) of a model of `config` built on the CPU whose
/// names `keep` accepts.
fn built_shapes<M: Benchable>(
    config: &M::Config,
    keep: impl Fn(&str) -> bool,
) -> Result<Vec<Vec<usize>>> {
    Ok(shapes_where(M::build(config, &Device::Cpu, 0)?.params(), keep))
}

/// The shapes of the parameters of `store`, trained or frozen, whose names `keep` accepts
/// (`params::lora::is_adapter`, say), in name order.
pub fn shapes_where(store: &ParamStore, keep: impl Fn(&str) -> bool) -> Vec<Vec<usize>> {
    let all = store.named().chain(store.frozen());
    all.filter(|(name, _)| keep(name)).map(|(_, v)| v.dims().to_vec()).collect()
}

/// The optimizers a run can train with, by name (`sgd`, `adamw`, `adafactor`: the trainers' and
/// the harness's `--optimizer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerKind {
    /// [`optim::SgdMomentum`]: one buffer per parameter.
    Sgd,
    /// [`optim::AdamW`]: two moments per parameter.
    Adamw,
    /// [`optim::Adafactor`]: a factored second moment, R + C numbers per R x C weight.
    Adafactor,
}

named_choice!(OptimizerKind, "optimizer", [
    OptimizerKind::Sgd => "sgd",
    OptimizerKind::Adamw => "adamw",
    OptimizerKind::Adafactor => "adafactor",
]);

impl OptimizerKind {
    /// The optimizer over `vars` with learning rate `lr` and otherwise PyTorch's defaults (SGD:
    /// momentum 0.9, weight decay 1e-4).
    pub fn build(self, vars: Vec<Var>, lr: f64) -> Result<Box<dyn TrainOptimizer>> {
        Ok(match self {
            OptimizerKind::Sgd => {
                Box::new(SgdMomentum::new(vars, ParamsSgd { lr, ..Default::default() })?)
            }
            OptimizerKind::Adamw => {
                Box::new(AdamW::new(vars, ParamsAdamW { lr, ..Default::default() })?)
            }
            OptimizerKind::Adafactor => {
                Box::new(Adafactor::new(vars, ParamsAdafactor { lr, ..Default::default() })?)
            }
        })
    }

    /// The learning rate the benchmarks train with.
    pub fn bench_lr(self) -> f64 {
        match self {
            OptimizerKind::Sgd => 0.05,
            OptimizerKind::Adamw => 1e-4,
            OptimizerKind::Adafactor => 1e-2,
        }
    }
}
