//! What the harness can run: one entry per model configuration of each profile.

use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use datasets::tokens::Batcher;
use remat::{Policy, StageGraph};

/// A model built and ready to train: its graph, parameters, data and optimizer.
pub trait Instance {
    fn graph(&self) -> &StageGraph;
    fn params(&self) -> Vec<Var>;
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
    /// e.g. `gpt2-small`.
    pub model: String,
    pub batch: usize,
    /// Input size in words, e.g. `seq 256`.
    pub input: String,
    kind: Kind,
}

#[derive(Clone, Debug)]
enum Kind {
    Gpt2 { config: gpt2::Config, seq: usize },
}

pub const PROFILES: &str = "smoke, cpu, full";

/// The configurations of a profile.
pub fn profile(name: &str) -> Result<Vec<Workload>> {
    use gpt2::Preset;
    let gpt2 = |name: &str, config: gpt2::Config, batch: usize, seq: usize| Workload {
        model: name.to_string(),
        batch,
        input: format!("seq {seq}"),
        kind: Kind::Gpt2 { config, seq },
    };
    Ok(match name {
        "smoke" => vec![gpt2("gpt2-tiny", gpt2::Config::tiny(4, 32), 2, 32)],
        "cpu" => vec![gpt2("gpt2-small", Preset::Small.config(), 2, 256)],
        "full" => vec![
            gpt2("gpt2-small", Preset::Small.config(), 1, 1024),
            gpt2("gpt2-medium", Preset::Medium.config(), 1, 1024),
            gpt2("gpt2-large", Preset::Large.config(), 1, 1024),
            gpt2("gpt2-xl", Preset::Xl.config(), 1, 1024),
        ],
        other => bail!("unknown profile `{other}`; valid profiles: {PROFILES}"),
    })
}

impl Workload {
    /// The policies that apply to this model (`before-downsample` needs downsampling stages).
    pub fn policies(&self) -> Vec<Policy> {
        let all = [Policy::Off, Policy::Sqrt, Policy::EveryN(2), Policy::BeforeDownsample];
        match self.kind {
            Kind::Gpt2 { .. } => all.into_iter().filter(|p| *p != Policy::BeforeDownsample).collect(),
        }
    }

    pub fn build(&self, device: &Device, seed: u64) -> Result<Box<dyn Instance>> {
        match &self.kind {
            Kind::Gpt2 { config, seq } => Ok(Box::new(Gpt2Instance::new(config.clone(), self.batch, *seq, device, seed)?)),
        }
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
    fn params(&self) -> Vec<Var> {
        self.model.params().vars()
    }
    fn inputs(&self, step: u64) -> Result<Vec<Tensor>> {
        let (x, y) = self.data.batch(step, self.batch);
        Ok(self.model.inputs(&x, &y, self.batch, self.seq, &self.device)?)
    }
    fn optimizer(&self) -> Result<OptimizerStep> {
        let mut opt = AdamW::new(self.params(), ParamsAdamW { lr: 3e-4, ..Default::default() })?;
        Ok(Box::new(move |g| Ok(opt.step(g)?)))
    }
}
