//! What the harness can run: one entry per model configuration of each profile.

use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use datasets::images::SyntheticImages;
use datasets::tokens::Batcher;
use datasets::volumes::SyntheticVolumes;
use layers::{ParamStore, ParamsSgd, SgdMomentum};
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
    let config = resnet::Config { classes: 10, ..preset.parse().expect("known preset") };
    Workload { model: model.into(), batch, kind: Kind::ResNet { config, size } }
}

fn bert(model: &str, config: bert::Config, batch: usize, seq: usize) -> Workload {
    Workload { model: model.into(), batch, kind: Kind::Bert { config, seq } }
}

fn unet3d(model: &str, preset: &str, batch: usize, side: usize) -> Workload {
    Workload { model: model.into(), batch, kind: Kind::UNet3d { config: preset.parse().expect("known preset"), side } }
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
    bert::Config::preset(name).expect("known preset")
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
        let mut all = vec![Policy::Off, Policy::Sqrt, Policy::EveryN(2)];
        if matches!(self.kind, Kind::ResNet { .. } | Kind::UNet3d { .. }) {
            all.push(Policy::BeforeDownsample);
        }
        all
    }

    pub fn build(&self, device: &Device, seed: u64) -> Result<Box<dyn Instance>> {
        Ok(match &self.kind {
            Kind::Gpt2 { config, seq } => Box::new(Gpt2Instance::new(config.clone(), self.batch, *seq, device, seed)?),
            Kind::Bert { config, seq } => Box::new(BertInstance {
                model: bert::Bert::new(config.clone(), device, seed)?,
                data: bert::MlmData::synthetic(config.vocab_size, *seq, seed)?,
                batch: self.batch,
                seq: *seq,
                device: device.clone(),
            }),
            Kind::UNet3d { config, side } => Box::new(UNet3dInstance {
                model: unet3d::UNet3d::new(config.clone(), device, seed)?,
                data: SyntheticVolumes::new(*side, seed),
                batch: self.batch,
                side: *side,
                device: device.clone(),
            }),
            Kind::ResNet { config, size } => Box::new(ResNetInstance {
                model: resnet::ResNet::new(config.clone(), device, seed)?,
                data: SyntheticImages::new(config.classes, *size, seed),
                batch: self.batch,
                size: *size,
                device: device.clone(),
            }),
        })
    }
}

struct Gpt2Instance {
    model: gpt2::Gpt2,
    data: Batcher,
    batch: usize,
    seq: usize,
    device: Device,
}

impl Gpt2Instance {
    fn new(config: gpt2::Config, batch: usize, seq: usize, device: &Device, seed: u64) -> Result<Self> {
        let tokens = datasets::text::byte_tokens(&datasets::text::synthetic_corpus(seed, 1 << 18));
        let data = Batcher::new(tokens, seq, config.vocab_size, seed)?;
        let model = gpt2::Gpt2::new(config, device, seed)?;
        Ok(Gpt2Instance { model, data, batch, seq, device: device.clone() })
    }
}

impl Instance for Gpt2Instance {
    fn graph(&self) -> &StageGraph {
        self.model.graph()
    }
    fn store(&self) -> &ParamStore {
        self.model.params()
    }
    fn inputs(&self, step: u64) -> Result<Vec<Tensor>> {
        let (x, y) = self.data.batch(step, self.batch);
        Ok(self.model.inputs(&x, &y, self.batch, self.seq, &self.device)?)
    }
    fn optimizer(&self) -> Result<OptimizerStep> {
        adamw(self.store())
    }
}

struct ResNetInstance {
    model: resnet::ResNet,
    data: SyntheticImages,
    batch: usize,
    size: usize,
    device: Device,
}

impl Instance for ResNetInstance {
    fn graph(&self) -> &StageGraph {
        self.model.graph()
    }
    fn store(&self) -> &ParamStore {
        self.model.params()
    }
    fn inputs(&self, step: u64) -> Result<Vec<Tensor>> {
        let (x, y) = self.data.batch(step, self.batch);
        Ok(self.model.inputs(&x, &y, self.size, &self.device)?)
    }
    fn optimizer(&self) -> Result<OptimizerStep> {
        let mut opt = SgdMomentum::new(self.store().vars(), ParamsSgd { lr: 0.05, ..Default::default() })?;
        Ok(Box::new(move |g| Ok(opt.step(g)?)))
    }
}

struct BertInstance {
    model: bert::Bert,
    data: bert::MlmData,
    batch: usize,
    seq: usize,
    device: Device,
}

impl Instance for BertInstance {
    fn graph(&self) -> &StageGraph {
        self.model.graph()
    }
    fn store(&self) -> &ParamStore {
        self.model.params()
    }
    fn inputs(&self, step: u64) -> Result<Vec<Tensor>> {
        Ok(self.model.inputs(&self.data.batch(step, self.batch), self.batch, self.seq, &self.device)?)
    }
    fn optimizer(&self) -> Result<OptimizerStep> {
        adamw(self.store())
    }
}

fn adamw(store: &ParamStore) -> Result<OptimizerStep> {
    let mut opt = AdamW::new(store.vars(), ParamsAdamW { lr: 1e-4, ..Default::default() })?;
    Ok(Box::new(move |g| Ok(opt.step(g)?)))
}

struct UNet3dInstance {
    model: unet3d::UNet3d,
    data: SyntheticVolumes,
    batch: usize,
    side: usize,
    device: Device,
}

impl Instance for UNet3dInstance {
    fn graph(&self) -> &StageGraph {
        self.model.graph()
    }
    fn store(&self) -> &ParamStore {
        self.model.params()
    }
    fn inputs(&self, step: u64) -> Result<Vec<Tensor>> {
        let (x, y) = self.data.batch(step, self.batch);
        Ok(self.model.inputs(&x, &y, self.side, &self.device)?)
    }
    fn optimizer(&self) -> Result<OptimizerStep> {
        adamw(self.store())
    }
}
