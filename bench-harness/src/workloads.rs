//! What the harness can run: one entry per model configuration of each profile.

use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor};
use candle_nn::Optimizer;
use datasets::images::SyntheticImages;
use datasets::tokens::Batcher;
use datasets::volumes::SyntheticVolumes;
use layers::{AdamW, Model, ParamStore, ParamsAdamW, ParamsSgd, SgdMomentum};
use remat::{Policy, StageGraph};

/// A model built and ready to train: its graph, parameters, data and optimizer.
pub trait Instance {
    fn graph(&self) -> &StageGraph;
    /// Parameters (trained) and buffers (BatchNorm statistics).
    fn store(&self) -> &ParamStore;
    /// The graph inputs of `step` (the same for every policy).
    fn inputs(&self, step: u64) -> Result<Vec<Tensor>>;
    /// A fresh optimizer over the parameters (separate from the instance, whose graph the
    /// executor borrows while the optimizer updates the weights).
    fn optimizer(&self) -> Result<OptimizerStep>;
}

pub type OptimizerStep = Box<dyn FnMut(&GradStore) -> Result<()>>;

/// One model configuration of a profile.
#[derive(Clone, Debug)]
pub struct Workload {
    /// e.g. `gpt2-small`, `resnet50`.
    pub model: String,
    pub batch: usize,
    kind: Kind,
}

#[derive(Clone, Debug)]
enum Kind {
    Gpt2 { config: gpt2::Config, seq: usize },
    ResNet { config: resnet::Config, size: usize },
    Bert { config: bert::Config, seq: usize },
    UNet3d { config: unet3d::Config, side: usize },
}

pub const PROFILES: &str = "smoke, cpu, full";

fn gpt2(model: &str, config: gpt2::Config, batch: usize, seq: usize) -> Workload {
    Workload { model: model.into(), batch, kind: Kind::Gpt2 { config, seq } }
}

fn resnet(model: &str, preset: &str, batch: usize, size: usize) -> Workload {
    let config = resnet::Config { classes: 10, ..preset.parse::<resnet::Preset>().expect("known preset").config() };
    Workload { model: model.into(), batch, kind: Kind::ResNet { config, size } }
}

fn bert(model: &str, config: bert::Config, batch: usize, seq: usize) -> Workload {
    Workload { model: model.into(), batch, kind: Kind::Bert { config, seq } }
}

fn unet3d(model: &str, preset: &str, batch: usize, side: usize) -> Workload {
    Workload { model: model.into(), batch, kind: Kind::UNet3d { config: preset.parse::<unet3d::Preset>().expect("known preset").config(), side } }
}

/// The configurations of a profile.
pub fn profile(name: &str) -> Result<Vec<Workload>> {
    use gpt2::Preset;
    Ok(match name {
        "smoke" => vec![
            resnet("resnet-tiny", "tiny", 2, 32),
            bert("bert-tiny", bert::Config::tiny(4, 32), 2, 16),
            unet3d("unet3d-tiny", "tiny", 2, 8),
            gpt2("gpt2-tiny", gpt2::Config::tiny(4, 32), 2, 32),
        ],
        "cpu" => vec![
            resnet("resnet50", "resnet50", 8, 128),
            resnet("resnet152", "resnet152", 4, 128),
            bert("bert-large", bert_preset("large"), 2, 128),
            unet3d("unet3d-small", "small", 2, 32),
            gpt2("gpt2-small", Preset::Small.config(), 2, 256),
        ],
        "full" => vec![
            resnet("resnet50", "resnet50", 256, 224),
            resnet("resnet152", "resnet152", 64, 224),
            bert("bert-large", bert_preset("large"), 32, 128),
            // The paper's 132x132x116 input at batch 8 needs ~100 GB of activations in f32 with
            // this conv3d; 64^3 keeps off within one GPU so that both sides can be measured.
            unet3d("unet3d-cicek", "cicek", 8, 64),
            gpt2("gpt2-small", Preset::Small.config(), 1, 1024),
            gpt2("gpt2-medium", Preset::Medium.config(), 1, 1024),
            gpt2("gpt2-large", Preset::Large.config(), 1, 1024),
            gpt2("gpt2-xl", Preset::Xl.config(), 1, 1024),
        ],
        other => bail!("unknown profile `{other}`; valid profiles: {PROFILES}"),
    })
}

fn bert_preset(name: &str) -> bert::Config {
    name.parse::<bert::Preset>().expect("known preset").config()
}

/// Models of the depth sweep are named `depth-<L>`.
pub const DEPTH_PREFIX: &str = "depth-";

/// The depth sweep of a profile: GPT-2 blocks of one width at growing depth, `off` and `sqrt`.
pub fn depth_sweep(profile: &str) -> Result<Vec<Workload>> {
    let (depths, width, batch, seq): (&[usize], usize, usize, usize) = match profile {
        "smoke" => (&[2, 4, 8, 16], 16, 2, 16),
        "cpu" => (&[16, 64, 256, 1024], 64, 2, 64),
        "full" => (&[16, 64, 256, 1024], 256, 4, 256),
        other => bail!("unknown profile `{other}`; valid profiles: {PROFILES}"),
    };
    Ok(depths.iter().map(|&l| gpt2(&format!("{DEPTH_PREFIX}{l}"), gpt2::Config::tiny(l, width), batch, seq)).collect())
}

impl Workload {
    /// The input size in words, e.g. `seq 256` or `128x128`.
    pub fn input(&self) -> String {
        match &self.kind {
            Kind::Gpt2 { seq, .. } | Kind::Bert { seq, .. } => format!("seq {seq}"),
            Kind::ResNet { size, .. } => format!("{size}x{size}"),
            Kind::UNet3d { side, .. } => format!("{side}^3"),
        }
    }

    /// The input size as a number: sequence length, image or volume side.
    pub fn input_size(&self) -> usize {
        match &self.kind {
            Kind::Gpt2 { seq, .. } | Kind::Bert { seq, .. } => *seq,
            Kind::ResNet { size, .. } => *size,
            Kind::UNet3d { side, .. } => *side,
        }
    }

    /// Overrides the batch and the input size (sequence length, image side).
    pub fn resized(mut self, batch: Option<usize>, input: Option<usize>) -> Self {
        self.batch = batch.unwrap_or(self.batch);
        if let Some(n) = input {
            match &mut self.kind {
                Kind::Gpt2 { seq, .. } | Kind::Bert { seq, .. } => *seq = n,
                Kind::ResNet { size, .. } => *size = n,
                Kind::UNet3d { side, .. } => *side = n,
            }
        }
        self
    }

    /// The policies that apply to this model (`before-downsample` needs downsampling stages).
    pub fn policies(&self) -> Vec<Policy> {
        if self.model.starts_with(DEPTH_PREFIX) {
            return vec![Policy::Off, Policy::Sqrt];
        }
        let mut all = vec![Policy::Off, Policy::Sqrt, Policy::EveryN(2)];
        if matches!(self.kind, Kind::ResNet { .. } | Kind::UNet3d { .. }) {
            all.push(Policy::BeforeDownsample);
        }
        all
    }

    pub fn build(&self, device: &Device, seed: u64) -> Result<Box<dyn Instance>> {
        let (batch, dev) = (self.batch, device.clone());
        Ok(match &self.kind {
            Kind::Gpt2 { config, seq } => {
                let seq = *seq;
                let tokens = datasets::text::byte_tokens(&datasets::text::synthetic_corpus(seed, 1 << 18));
                let data = Batcher::new(tokens, seq, config.vocab_size, seed)?;
                Box::new(Built {
                    model: gpt2::Gpt2::new(config.clone(), device, seed)?,
                    inputs: Box::new(move |m, step| {
                        let (x, y) = data.batch(step, batch);
                        Ok(m.inputs(&x, &y, batch, seq, &dev)?)
                    }),
                    optimizer: adamw,
                })
            }
            Kind::ResNet { config, size } => {
                let (size, data) = (*size, SyntheticImages::new(config.classes, *size, seed));
                Box::new(Built {
                    model: resnet::ResNet::new(config.clone(), device, seed)?,
                    inputs: Box::new(move |m, step| {
                        let (x, y) = data.batch(step, batch);
                        Ok(m.inputs(&x, &y, size, &dev)?)
                    }),
                    optimizer: sgd_momentum,
                })
            }
            Kind::Bert { config, seq } => {
                let (seq, data) = (*seq, bert::MlmData::synthetic(config.vocab_size, *seq, seed)?);
                Box::new(Built {
                    model: bert::Bert::new(config.clone(), device, seed)?,
                    inputs: Box::new(move |m, step| Ok(m.inputs(&data.batch(step, batch), batch, seq, &dev)?)),
                    optimizer: adamw,
                })
            }
            Kind::UNet3d { config, side } => {
                let (side, data) = (*side, SyntheticVolumes::new(*side, seed));
                Box::new(Built {
                    model: unet3d::UNet3d::new(config.clone(), device, seed)?,
                    inputs: Box::new(move |m, step| {
                        let (x, y) = data.batch(step, batch);
                        Ok(m.inputs(&x, &y, side, &dev)?)
                    }),
                    optimizer: adamw,
                })
            }
        })
    }
}

/// A step's graph inputs from the model and the step number.
type InputsFn<M> = Box<dyn Fn(&M, u64) -> Result<Vec<Tensor>>>;

/// A model with its data and optimizer: what every kind of model becomes.
struct Built<M> {
    model: M,
    inputs: InputsFn<M>,
    optimizer: fn(&ParamStore) -> Result<OptimizerStep>,
}

impl<M: Model> Instance for Built<M> {
    fn graph(&self) -> &StageGraph {
        self.model.graph()
    }
    fn store(&self) -> &ParamStore {
        self.model.params()
    }
    fn inputs(&self, step: u64) -> Result<Vec<Tensor>> {
        (self.inputs)(&self.model, step)
    }
    fn optimizer(&self) -> Result<OptimizerStep> {
        (self.optimizer)(self.store())
    }
}

fn adamw(store: &ParamStore) -> Result<OptimizerStep> {
    let mut opt = AdamW::new(store.vars(), ParamsAdamW { lr: 1e-4, ..Default::default() })?;
    Ok(Box::new(move |g| Ok(opt.step(g)?)))
}

fn sgd_momentum(store: &ParamStore) -> Result<OptimizerStep> {
    let mut opt = SgdMomentum::new(store.vars(), ParamsSgd { lr: 0.05, ..Default::default() })?;
    Ok(Box::new(move |g| Ok(opt.step(g)?)))
}
