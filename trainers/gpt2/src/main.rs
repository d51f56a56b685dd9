//! `train-gpt2`: train GPT-2 with activation checkpointing on the default corpus, a text file or a
//! token file.

use anyhow::Result;
use candle_core::Tensor;
use gpt2::{Config, Gpt2, Preset};
use remat::memory::CountingAlloc;
use remat::Policy;
use trainable::Model;
use trainkit::lora::{LoraArgs, Peft};
use trainkit::text::TokenData;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// GPT-2 stores its projections (in, out): torch's `Conv1D`.
const PEFT: Peft =
    Peft { targets: &gpt2::LORA_TARGETS, task_type: Some("CAUSAL_LM"), fan_in_fan_out: true };

#[derive(clap::Parser, Debug)]
#[command(about = "Train GPT-2 with activation checkpointing (candle + remat)")]
struct Args {
    /// Model size: tiny, small (124M), medium (350M), large (774M), xl (1.56B).
    #[arg(long, default_value = "small", conflicts_with_all = ["config", "model_id"])]
    preset: Preset,
    #[command(flatten)]
    pretrained: trainkit::hub::Pretrained,
    #[command(flatten)]
    run: trainkit::RunArgs,
    #[command(flatten)]
    text: trainkit::text::TokenArgs,
    #[command(flatten)]
    lora: LoraArgs,
}

fn main() -> Result<()> {
    trainkit::main::<Args>()
}

impl trainkit::Recipe for Args {
    type Model = Gpt2;
    type Data = TokenData;
    const MODEL: &'static str = "GPT-2";
    const MODEL_FLAGS: &'static str = "--preset, --config or --model-id";

    fn defaults() -> trainkit::Defaults {
        let (steps, batch, optimizer, lr) = (50, 2, trainable::OptimizerKind::Adamw, 6e-4);
        trainkit::Defaults { policy: remat::Policy::Sqrt.into(), steps, batch, optimizer, lr }
    }

    fn flags(&self) -> trainkit::Flags<'_> {
        let (run, sources, lora) =
            (&self.run, self.pretrained.sources(), Some((&self.lora, &PEFT)));
        trainkit::Flags { run, sources, lora }
    }

    fn input_size(&self) -> (&'static str, usize) {
        ("--seq", self.text.seq)
    }

    fn preset(&self) -> Config {
        self.preset.config()
    }

    fn check(&self, config: &Config) -> Result<()> {
        self.text.check_context(config.n_positions)
    }

    fn data(
        &self,
        config: &mut Config,
        hub: Option<&trainkit::hub::HubFiles>,
    ) -> Result<TokenData> {
        self.text.batcher(config.vocab_size, self.run.seed, hub, &self.pretrained.beside())
    }

    fn inputs(&self, model: &Gpt2, data: &TokenData, step: u64, n: usize) -> Result<Vec<Tensor>> {
        let device = model.params().device();
        let (x, y) = data.batch(step, n); // (B, T) token ids, (B, T) the next ones
        Ok(model.inputs(&x, &y, n, self.text.seq, device)?)
    }

    fn read_files(&self, hub: Option<&trainkit::hub::HubFiles>) -> Vec<trainkit::inputs::Input> {
        self.text.files(hub, &self.pretrained.beside())
    }

    fn samples(&self, data: &TokenData) -> Option<usize> {
        Some(data.samples())
    }

    fn setup(&self, _: &Config) -> impl serde::Serialize {
        &self.text
    }

    fn describe(&self, model: &Gpt2, _: &TokenData, policy: &Policy, segments: &str) -> String {
        format!(
            "GPT-2 {}, {} layers, policy {policy} ({segments}), batch {} x seq {}",
            model.params().count_text(),
            model.config.n_layer,
            self.run.batch,
            self.text.seq
        )
    }
}
