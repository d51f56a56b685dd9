//! `train-llama`: fine-tune a decoder of the Llama family (Llama 3.x, Mistral, Qwen2.5, Qwen3,
//! SmolLM2) with activation checkpointing, fully or with LoRA, on the default corpus, a text file
//! or a token file.

use anyhow::Result;
use candle_core::Tensor;
use llama::{Config, Llama, Preset};
use remat::memory::CountingAlloc;
use remat::Policy;
use trainable::Model;
use trainkit::lora::{LoraArgs, Peft};
use trainkit::text::TokenData;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// The projections are `nn.Linear`, stored (out, in).
const PEFT: Peft =
    Peft { targets: &llama::LORA_TARGETS, task_type: Some("CAUSAL_LM"), fan_in_fan_out: false };

#[derive(clap::Parser, Debug)]
#[command(about = "Fine-tune a Llama-family model with activation checkpointing (candle + remat)")]
struct Args {
    /// Model shape: tiny, smollm2-135m, qwen2.5-0.5b, qwen3-0.6b, llama-3.2-1b, llama-3.2-3b,
    /// qwen2.5-7b, llama-3.1-8b (random weights: give --config/--init or --model-id to fine-tune).
    #[arg(long, default_value = "tiny", conflicts_with_all = ["config", "model_id"])]
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
    type Model = Llama;
    type Data = TokenData;
    const MODEL: &'static str = "Llama-family";
    const MODEL_FLAGS: &'static str = "--preset, --config or --model-id";

    fn defaults() -> trainkit::Defaults {
        let (steps, batch, optimizer, lr) = (50, 2, trainable::OptimizerKind::Adamw, 1e-4);
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

    /// A sequence beyond the context, or beyond Mistral's sliding window (not implemented:
    /// within it, attention is plain causal).
    fn check(&self, config: &Config) -> Result<()> {
        self.text.check_context(config.max_position_embeddings)?;
        if let Some(window) = config.sliding_window.filter(|&w| self.text.seq > w) {
            anyhow::bail!(
                "--seq {} is beyond the model's sliding_window ({window}), which this crate does \
                 not implement; use --seq {window} or less",
                self.text.seq
            );
        }
        Ok(())
    }

    fn data(
        &self,
        config: &mut Config,
        hub: Option<&trainkit::hub::HubFiles>,
    ) -> Result<TokenData> {
        self.text.batcher(config.vocab_size, self.run.seed, hub, &self.pretrained.beside())
    }

    fn inputs(&self, model: &Llama, data: &TokenData, step: u64, n: usize) -> Result<Vec<Tensor>> {
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

    fn describe(&self, model: &Llama, _: &TokenData, policy: &Policy, segments: &str) -> String {
        let c = &model.config;
        format!(
            "{:?} {}, {} layers, {} heads ({} key/value), policy {policy} ({segments}), batch {} \
             x seq {}",
            c.architecture,
            model.params().count_text(),
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            self.run.batch,
            self.text.seq
        )
    }
}
