//! What the harness can run: one entry per model configuration of each profile.

use anyhow::Result;
use bert::Bert;
use candle_core::{Device, Tensor};
use gpt2::Gpt2;
use llama::Llama;
use optim::TrainOptimizer;
use params::ParamStore;
use remat::{Policy, StageGraph};
use resnet::ResNet;
use std::sync::Arc;
use trainable::{Benchable, OptimizerKind, Precision};
use unet3d::UNet3d;

/// The `gpt2-24gb` variant with the optimizer inside backward (f32 activations, AdamW).
pub const IN_BACKWARD: &str = "f32-adamw-in-backward";

/// The memory of the card the article's GPT-2 claim names (24 GiB): every projection also plans
/// for it, and `gpt2-24gb` measures against it.
pub const CARD_BYTES: u64 = 24 << 30;

/// A model built and ready to train: its graph, parameters, data and optimizer.
pub trait Instance {
    fn graph(&self) -> &StageGraph;
    /// Parameters (trained) and buffers (BatchNorm statistics).
    fn store(&self) -> &ParamStore;
    /// The graph inputs of `step` (the same for every policy).
    fn inputs(&self, step: u64) -> Result<Vec<Tensor>> {
        self.inputs_at(step, self.batch())
    }
    /// The graph inputs of `step` at another batch size (the planner's profiles).
    fn inputs_at(&self, step: u64, batch: usize) -> Result<Vec<Tensor>>;
    fn batch(&self) -> usize;
    /// A fresh optimizer over the parameters (separate from the instance, whose graph the
    /// executor borrows while the optimizer updates the weights); with `shard`, its state
    /// sharded over the ranks of `group` (ZeRO stage 1).
    fn optimizer<'g>(
        &self,
        shard: bool,
        group: &'g trainkit::Group,
    ) -> Result<Box<dyn TrainOptimizer + 'g>>;
}

/// One model configuration of a profile.
#[derive(Clone, Debug)]
pub struct Workload {
    /// e.g. `gpt2-small`, `resnet50`.
    pub model: String,
    pub batch: usize,
    /// Sequence length, image side or volume side.
    pub input_size: usize,
    /// Micro-batches of `batch` per optimizer step (gradient accumulation).
    pub accumulate: usize,
    /// The optimizer, where not the model's benchmark default.
    optimizer: Option<OptimizerKind>,
    /// The dtype activations are computed in.
    pub dtype: Precision,
    /// Data parallelism only: the optimizer state sharded over the ranks (ZeRO stage 1).
    pub shard_optimizer: bool,
    /// The optimizer inside backward (`--optimizer-in-backward`): one micro-batch per step.
    pub in_backward: bool,
    /// A memory budget whose plan (`budget=`) the matrix runs by default beside the policies.
    pub budget: Option<u64>,
    family: Arc<dyn Family>,
}

/// A model family with its configuration, whatever the model: the one place the harness meets a
/// model's type.
trait Family: std::fmt::Debug {
    fn describe_input(&self, size: usize) -> String;
    fn downsamples(&self) -> bool;
    fn check_keep(&self, policy: &Policy) -> std::result::Result<(), String>;
    fn optimizer(&self) -> OptimizerKind;
    fn step_floor(&self, batch: usize, size: usize) -> (&'static str, Option<u128>);
    fn shapes(&self) -> Result<Shapes>;
    /// The model of workload `w` (whose family this is) at its batch, input size, dtype and
    /// optimizer.
    fn build(&self, w: &Workload, device: &Device, seed: u64) -> Result<Box<dyn Instance>>;
    /// [`Family::build`] with only `blocks` of its repeated blocks, and how many the whole model
    /// has (`None` where it is not one run of alike blocks).
    fn build_shallow(
        &self,
        w: &Workload,
        blocks: usize,
        device: &Device,
        seed: u64,
    ) -> Result<Option<(Box<dyn Instance>, usize)>>;
}

struct Config<M: Benchable>(M::Config);

impl<M: Benchable> std::fmt::Debug for Config<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<M: Benchable> Family for Config<M> {
    fn describe_input(&self, size: usize) -> String {
        M::describe_input(size)
    }
    fn downsamples(&self) -> bool {
        M::DOWNSAMPLES
    }
    fn check_keep(&self, policy: &Policy) -> std::result::Result<(), String> {
        M::check_keep(policy)
    }
    fn optimizer(&self) -> OptimizerKind {
        M::OPTIMIZER
    }
    fn step_floor(&self, batch: usize, size: usize) -> (&'static str, Option<u128>) {
        M::step_floor(&self.0, batch, size)
    }
    fn shapes(&self) -> Result<Shapes> {
        Ok(Shapes { base: M::parameter_shapes(&self.0)?, adapters: M::adapter_shapes(&self.0)? })
    }
    fn build(&self, w: &Workload, device: &Device, seed: u64) -> Result<Box<dyn Instance>> {
        built::<M>(&self.0, w, device, seed)
    }
    fn build_shallow(
        &self,
        w: &Workload,
        blocks: usize,
        device: &Device,
        seed: u64,
    ) -> Result<Option<(Box<dyn Instance>, usize)>> {
        let Some((shallow, depth)) = M::shallow(&self.0, blocks) else { return Ok(None) };
        Ok(Some((built::<M>(&shallow, w, device, seed)?, depth)))
    }
}

/// A model of `config` built for workload `w`: its dtype, synthetic data, batch and optimizer.
fn built<M: Benchable>(
    config: &M::Config,
    w: &Workload,
    device: &Device,
    seed: u64,
) -> Result<Box<dyn Instance>> {
    let model = M::build(&M::with_dtype(config, w.dtype), device, seed)?;
    let data = model.synthetic_data(w.input_size, seed)?;
    let (batch, optimizer) = (w.batch, w.optimizer());
    Ok(Box::new(Built { model, data, batch, optimizer, device: device.clone() }))
}

/// The shapes of a model's parameters, without building it.
#[derive(Clone, Debug, Default)]
pub struct Shapes {
    /// The model's own parameters: under LoRA frozen, else trained (the harness freezes nothing
    /// else).
    pub base: Vec<Vec<usize>>,
    /// Its LoRA adapters (none without LoRA): the parameters that train under LoRA.
    pub adapters: Vec<Vec<usize>>,
}

impl Shapes {
    /// The shapes of a built model's parameters and adapters.
    pub fn of(store: &ParamStore) -> Shapes {
        use params::lora::is_adapter;
        Shapes {
            base: trainable::shapes_where(store, |name| !is_adapter(name)),
            adapters: trainable::shapes_where(store, is_adapter),
        }
    }

    /// The parameters that train, and those that do not.
    fn trained_and_frozen(&self) -> (&[Vec<usize>], &[Vec<usize>]) {
        match self.adapters.is_empty() {
            true => (&self.base, &[]),
            false => (&self.adapters, &self.base),
        }
    }
}

/// The workload `model` of the model type `M` with `config`, at `batch` and `input_size`.
fn workload<M: Benchable>(
    model: &str,
    config: M::Config,
    batch: usize,
    input_size: usize,
) -> Workload {
    Workload {
        model: model.into(),
        batch,
        input_size,
        accumulate: 1,
        optimizer: None,
        dtype: Precision::F32,
        shard_optimizer: false,
        in_backward: false,
        budget: None,
        family: Arc::new(Config::<M>(config)),
    }
}

/// A set of configurations (`--profile`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Profile {
    /// Tiny models, seconds.
    Smoke,
    /// Minutes per model on a CPU.
    Cpu,
    /// The article's sizes.
    Full,
    /// The profile of `--matrix gpt2-24gb`.
    #[value(name = "gpt2-24gb")]
    Gpt2_24gb,
    /// The profile of `--matrix llm-24gb`.
    #[value(name = "llm-24gb")]
    Llm24gb,
    /// The Llama family on a CPU: SmolLM2-135M, full fine-tuning and LoRA.
    Llama,
}

impl Profile {
    /// The name results folders and records use.
    pub fn name(self) -> &'static str {
        match self {
            Profile::Smoke => "smoke",
            Profile::Cpu => "cpu",
            Profile::Full => "full",
            Profile::Gpt2_24gb => "gpt2-24gb",
            Profile::Llm24gb => "llm-24gb",
            Profile::Llama => "llama",
        }
    }
}

impl Profile {
    /// Whether it asks what fits a 24 GiB card (`gpt2-24gb`, `llm-24gb`): every configuration
    /// predicted at its size first, run only where it fits the memory cap.
    pub fn asks_24gb(self) -> bool {
        matches!(self, Profile::Gpt2_24gb | Profile::Llm24gb)
    }
}

impl std::fmt::Display for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A ResNet preset with the 10 classes of the synthetic images.
fn resnet(preset: resnet::Preset) -> resnet::Config {
    resnet::Config { classes: 10, ..preset.config() }
}

/// What `--lora 8 --lora-alpha 16` trains on `targets`, with B drawn instead of zeros (PEFT's
/// `init_lora_weights=False`), so that every adapter gets a gradient for the check.
fn lora(targets: &[&str]) -> Option<params::lora::Lora> {
    lora_of_rank(8, targets)
}

/// [`lora`] of rank `rank`, alpha twice the rank.
fn lora_of_rank(rank: usize, targets: &[&str]) -> Option<params::lora::Lora> {
    Some(params::lora::Lora {
        rank,
        alpha: 2.0 * rank as f64,
        dropout: 0.0,
        targets: targets.iter().map(|t| t.to_string()).collect(),
        init_lora_weights: false,
    })
}

/// The configurations of a profile.
pub fn profile(profile: Profile) -> Vec<Workload> {
    use {bert::Preset as B, gpt2::Preset as G, llama::Preset as L};
    use {resnet::Preset as R, unet3d::Preset as U};
    match profile {
        Profile::Smoke => vec![
            workload::<ResNet>("resnet-tiny", resnet(R::Tiny), 2, 32),
            workload::<Bert>("bert-tiny", B::Tiny.config(), 2, 16),
            workload::<UNet3d>("unet3d-tiny", U::Tiny.config(), 2, 8),
            workload::<Gpt2>("gpt2-tiny", gpt2::Config::tiny(4, 32), 2, 32),
            workload::<Llama>(
                "llama-tiny",
                llama::Config { num_hidden_layers: 4, ..L::Tiny.config() },
                2,
                32,
            ),
        ],
        Profile::Cpu => vec![
            workload::<ResNet>("resnet50", resnet(R::Resnet50), 8, 128),
            workload::<ResNet>("resnet152", resnet(R::Resnet152), 4, 128),
            workload::<Bert>("bert-large", B::Large.config(), 2, 128),
            workload::<UNet3d>("unet3d-small", U::Small.config(), 2, 32),
            workload::<Gpt2>("gpt2-small", G::Small.config(), 2, 256),
            // LoRA fine-tuning beside full fine-tuning of the same model and batch.
            workload::<Bert>(
                "bert-large-lora",
                bert::Config { lora: lora(&bert::LORA_TARGETS), ..B::Large.config() },
                2,
                128,
            ),
            workload::<Gpt2>(
                "gpt2-small-lora",
                gpt2::Config { lora: lora(&gpt2::LORA_TARGETS), ..G::Small.config() },
                2,
                256,
            ),
        ]
        .into_iter()
        .chain(smollm2_135m())
        .collect(),
        Profile::Full => vec![
            workload::<ResNet>("resnet50", resnet(R::Resnet50), 256, 224),
            workload::<ResNet>("resnet152", resnet(R::Resnet152), 64, 224),
            workload::<Bert>("bert-large", B::Large.config(), 32, 128),
            // The paper's 132x132x116 input at batch 8 needs ~100 GB of activations in f32 with
            // this conv3d; 64^3 keeps off within one GPU so that both sides can be measured.
            workload::<UNet3d>("unet3d-cicek", U::Cicek.config(), 8, 64),
            workload::<Gpt2>("gpt2-small", G::Small.config(), 1, 1024),
            workload::<Gpt2>("gpt2-medium", G::Medium.config(), 1, 1024),
            workload::<Gpt2>("gpt2-large", G::Large.config(), 1, 1024),
            workload::<Gpt2>("gpt2-xl", G::Xl.config(), 1, 1024),
        ],
        Profile::Gpt2_24gb => gpt2_24gb(),
        Profile::Llm24gb => llm_24gb(),
        Profile::Llama => smollm2_135m().to_vec(),
    }
}

/// The Llama family at SmolLM2-135M's shape, batch 2 x 512: fully fine-tuned, and under LoRA of
/// rank 16 on all seven projections, as it is usually fine-tuned; each with one `budget=` plan
/// between `sqrt`'s memory and `off`'s.
fn smollm2_135m() -> [Workload; 2] {
    let config = llama::Preset::Smollm2_135m.config();
    let lora = llama::Config { lora: lora_of_rank(16, &llama::LORA_TARGETS), ..config.clone() };
    [
        Workload { budget: Some(2816 << 20), ..workload::<Llama>("smollm2-135m", config, 2, 512) },
        Workload {
            budget: Some(1536 << 20),
            ..workload::<Llama>("smollm2-135m-lora", lora, 2, 512)
        },
    ]
}

/// The ways `gpt2-24gb` holds a model's state: (name, activation dtype, optimizer, the optimizer
/// inside backward).
pub const STATE_VARIANTS: [(&str, Precision, OptimizerKind, bool); 5] = [
    ("f32-adamw", Precision::F32, OptimizerKind::Adamw, false),
    ("bf16-adamw", Precision::Bf16, OptimizerKind::Adamw, false),
    ("bf16-weights-adamw", Precision::Bf16Weights, OptimizerKind::Adamw, false),
    ("bf16-adafactor", Precision::Bf16, OptimizerKind::Adafactor, false),
    (IN_BACKWARD, Precision::F32, OptimizerKind::Adamw, true),
];

/// Micro-batches per step in `gpt2-24gb` and `llm-24gb`: batch 1, effective batch 8.
pub const ACCUMULATE_24GB: usize = 8;

/// GPT-2 at every published size at batch 1 and sequence 1024, 8 micro-batches accumulated per
/// step (one with the optimizer inside backward), in each of [`STATE_VARIANTS`]: named
/// `gpt2-<size>/<variant>`.
fn gpt2_24gb() -> Vec<Workload> {
    use gpt2::Preset as G;
    let sizes = [("small", G::Small), ("medium", G::Medium), ("large", G::Large), ("xl", G::Xl)];
    sizes
        .into_iter()
        .flat_map(|(size, preset)| {
            STATE_VARIANTS.into_iter().map(move |(variant, dtype, optimizer, in_backward)| {
                Workload {
                    accumulate: if in_backward { 1 } else { ACCUMULATE_24GB },
                    dtype,
                    optimizer: Some(optimizer),
                    in_backward,
                    ..workload::<Gpt2>(&format!("gpt2-{size}/{variant}"), preset.config(), 1, 1024)
                }
            })
        })
        .collect()
}

/// The ways `llm-24gb` fine-tunes a model: (name, dtype, the optimizer inside backward, LoRA), each
/// with AdamW; in order of preference as a change that makes a configuration fit (LoRA is
/// another kind of fine-tuning, not such a change).
pub const LLM_VARIANTS: [(&str, Precision, bool, bool); 4] = [
    ("f32-adamw", Precision::F32, false, false),
    ("bf16-weights-adamw", Precision::Bf16Weights, false, false),
    (IN_BACKWARD, Precision::F32, true, false),
    // Over a frozen bf16 base, as LoRA is usually run.
    (LORA_R16, Precision::Bf16Weights, false, true),
];

/// The `llm-24gb` variant of LoRA (rank 16, alpha 32, on all seven projections).
pub const LORA_R16: &str = "lora-r16";

/// The sequences `llm-24gb` asks at.
pub const LLM_SEQS: [usize; 2] = [2048, 4096];

/// The Llama-family models users fine-tune, from 0.5B to 8B parameters, at batch 1 and each of
/// [`LLM_SEQS`], 8 micro-batches accumulated per step (one with the optimizer inside backward),
/// in each of [`LLM_VARIANTS`]: named `<model>/<seq>/<variant>`.
fn llm_24gb() -> Vec<Workload> {
    use llama::Preset as L;
    let models = [
        ("qwen2.5-0.5b", L::Qwen2_5_0_5b),
        ("llama-3.2-1b", L::Llama3_2_1b),
        ("llama-3.2-3b", L::Llama3_2_3b),
        ("qwen2.5-7b", L::Qwen2_5_7b),
        ("llama-3.1-8b", L::Llama3_1_8b),
    ];
    let configs = LLM_SEQS.into_iter().flat_map(|seq| models.map(move |m| (seq, m)));
    configs
        .flat_map(|(seq, (model, preset))| {
            LLM_VARIANTS.into_iter().map(move |(variant, dtype, in_backward, adapted)| {
                let lora = adapted.then(|| lora_of_rank(16, &llama::LORA_TARGETS)).flatten();
                let config = llama::Config { lora, ..preset.config() };
                Workload {
                    accumulate: if in_backward { 1 } else { ACCUMULATE_24GB },
                    dtype,
                    optimizer: Some(OptimizerKind::Adamw),
                    in_backward,
                    ..workload::<Llama>(&format!("{model}/{seq}/{variant}"), config, 1, seq)
                }
            })
        })
        .collect()
}

/// Models of the depth sweep are named `depth-<L>`.
pub const DEPTH_PREFIX: &str = "depth-";

/// The depth sweep of a profile: GPT-2 blocks of one width at growing depth, `off` and `sqrt`.
pub fn depth_sweep(profile: Profile) -> Vec<Workload> {
    let (depths, width, batch, seq): (&[usize], usize, usize, usize) = match profile {
        Profile::Smoke => (&[2, 4, 8, 16], 16, 2, 16),
        Profile::Cpu => (&[16, 64, 256, 1024], 64, 2, 64),
        Profile::Full => (&[16, 64, 256, 1024], 256, 4, 256),
        Profile::Gpt2_24gb | Profile::Llm24gb | Profile::Llama => return Vec::new(),
    };
    depths
        .iter()
        .map(|&l| {
            workload::<Gpt2>(
                &format!("{DEPTH_PREFIX}{l}"),
                gpt2::Config::tiny(l, width),
                batch,
                seq,
            )
        })
        .collect()
}

/// The bytes of the parameters (trained and frozen) and of the trained ones' gradients, in
/// `precision`'s weight dtype, and of `optimizer`'s state (f32) over the trained ones.
pub fn state(shapes: &Shapes, optimizer: OptimizerKind, precision: Precision) -> (u64, u64, u64) {
    let count = |s: &Vec<usize>| s.iter().product::<usize>() as u64;
    let (trained, frozen) = shapes.trained_and_frozen();
    let n: u64 = trained.iter().map(count).sum();
    let state = match optimizer {
        OptimizerKind::Sgd => n,
        OptimizerKind::Adamw => 2 * n,
        OptimizerKind::Adafactor => trained
            .iter()
            .map(|s| match s.as_slice() {
                [lead @ .., r, c] => lead.iter().product::<usize>() as u64 * (r + c) as u64,
                _ => count(s),
            })
            .sum(),
    };
    let weight = precision.weights().size_in_bytes() as u64;
    let all = n + frozen.iter().map(count).sum::<u64>();
    (weight * all, weight * n, 4 * state)
}

/// Changes to a workload from the command line: `None` keeps the profile's.
#[derive(Clone, Copy, Debug, Default)]
pub struct Overrides {
    pub batch: Option<usize>,
    pub input_size: Option<usize>,
    pub accumulate: Option<usize>,
    pub optimizer: Option<OptimizerKind>,
    pub dtype: Option<Precision>,
    pub shard_optimizer: bool,
}

impl Workload {
    /// The input size in words, e.g. `seq 256` or `128x128`.
    pub fn input(&self) -> String {
        self.family.describe_input(self.input_size)
    }

    /// The workload with what `o` sets changed; the optimizer inside backward keeps its one
    /// micro-batch (a gradient is final only after the last one's backward).
    pub fn overridden(self, o: Overrides) -> Self {
        Workload {
            batch: o.batch.unwrap_or(self.batch),
            input_size: o.input_size.unwrap_or(self.input_size),
            accumulate: if self.in_backward { 1 } else { o.accumulate.unwrap_or(self.accumulate) },
            optimizer: o.optimizer.or(self.optimizer),
            dtype: o.dtype.unwrap_or(self.dtype),
            shard_optimizer: o.shard_optimizer || self.shard_optimizer,
            ..self
        }
    }

    /// A tensor each of its steps holds whatever the policy, named, in elements
    /// ([`trainable::Benchable::step_floor`]).
    pub fn step_floor(&self) -> (&'static str, Option<u128>) {
        self.family.step_floor(self.batch, self.input_size)
    }

    /// The shapes of its parameters and adapters, from its configuration.
    pub fn shapes(&self) -> Result<Shapes> {
        self.family.shapes()
    }

    /// Its state by arithmetic on the parameter `shapes` ([`state`]): the parameters, the
    /// gradients held at once (none with the optimizer inside backward, which frees each as it
    /// applies it: those in flight are the step's) and the optimizer's state.
    pub fn state(&self, shapes: &Shapes) -> (u64, u64, u64) {
        let (params, grads, optimizer) = state(shapes, self.optimizer(), self.dtype);
        (params, if self.in_backward { 0 } else { grads }, optimizer)
    }

    /// The optimizer it trains with.
    pub fn optimizer(&self) -> OptimizerKind {
        self.optimizer.unwrap_or_else(|| self.family.optimizer())
    }

    /// Whether `policy` applies to this model (`before-downsample` needs downsampling stages,
    /// `+keep=` ops of the kinds it names).
    pub fn applies(&self, policy: &Policy) -> bool {
        match policy {
            Policy::BeforeDownsample => self.family.downsamples(),
            Policy::Keep(cut, _) => self.applies(cut) && self.family.check_keep(policy).is_ok(),
            Policy::Units(cut, _) => self.applies(cut),
            _ => true,
        }
    }

    /// The policies the matrix runs on this model by default.
    pub fn policies(&self) -> Vec<Policy> {
        if self.model.starts_with(DEPTH_PREFIX) {
            return vec![Policy::Off, Policy::Sqrt];
        }
        [Policy::Off, Policy::Sqrt, Policy::EveryN(2), Policy::BeforeDownsample]
            .into_iter()
            .filter(|p| self.applies(p))
            .collect()
    }

    pub fn build(&self, device: &Device, seed: u64) -> Result<Box<dyn Instance>> {
        self.family.build(self, device, seed)
    }

    /// The model with only `blocks` of its repeated blocks, and how many it has in all (`None`
    /// where it is not one run of alike blocks): what a projection profiles where the whole
    /// model's weights would not fit ([`trainable::Benchable::shallow`]).
    pub fn build_shallow(
        &self,
        blocks: usize,
        device: &Device,
        seed: u64,
    ) -> Result<Option<(Box<dyn Instance>, usize)>> {
        self.family.build_shallow(self, blocks, device, seed)
    }
}

/// A model with its synthetic data: what every kind of model becomes.
struct Built<M: Benchable> {
    model: M,
    data: M::Data,
    batch: usize,
    optimizer: OptimizerKind,
    device: Device,
}

impl<M: Benchable> Instance for Built<M> {
    fn graph(&self) -> &StageGraph {
        self.model.graph()
    }
    fn store(&self) -> &ParamStore {
        self.model.params()
    }
    fn inputs_at(&self, step: u64, batch: usize) -> Result<Vec<Tensor>> {
        Ok(self.model.synthetic_inputs(&self.data, step, batch, &self.device)?)
    }
    fn batch(&self) -> usize {
        self.batch
    }
    fn optimizer<'g>(
        &self,
        shard: bool,
        group: &'g trainkit::Group,
    ) -> Result<Box<dyn TrainOptimizer + 'g>> {
        trainkit::optimizer(
            trainkit::parallel::OptimizerState::from_flag(shard),
            group,
            self.optimizer,
            self.model.params().vars(),
            self.optimizer.bench_lr(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-2 XL's published parameter count and the bytes per parameter of each way of holding
    /// its state: f32 weights, gradients and AdamW moments 16; bf16 weights and gradients with f32
    /// moments 12; Adafactor's factored statistics a few MB beside f32 weights and gradients.
    #[test]
    fn the_state_of_gpt2_xl_by_arithmetic() {
        let base =
            <gpt2::Gpt2 as trainable::Benchable>::parameter_shapes(&gpt2::Preset::Xl.config())
                .unwrap();
        let n: u64 = base.iter().map(|s| s.iter().product::<usize>() as u64).sum();
        let shapes = Shapes { base, adapters: Vec::new() };
        assert_eq!(n, 1_557_611_200);
        let total = |(p, g, o): (u64, u64, u64)| p + g + o;
        assert_eq!(total(state(&shapes, OptimizerKind::Adamw, Precision::F32)), 16 * n);
        assert_eq!(total(state(&shapes, OptimizerKind::Adamw, Precision::Bf16)), 16 * n);
        assert_eq!(total(state(&shapes, OptimizerKind::Adamw, Precision::Bf16Weights)), 12 * n);
        let (p, g, o) = state(&shapes, OptimizerKind::Adafactor, Precision::Bf16);
        assert_eq!((p, g), (4 * n, 4 * n));
        assert!(o < 20 << 20, "Adafactor's state of GPT-2 XL: {o} bytes");
    }
}
