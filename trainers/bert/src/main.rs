//! `train-bert`: masked-LM training of BERT with activation checkpointing.

use anyhow::{bail, Context, Result};
use bert::{Bert, Config, MlmData, Preset};
use candle_core::Tensor;
use datasets::text::WordVocab;
use datasets::tokenizer::Tokenizer;
use remat::memory::CountingAlloc;
use remat::Policy;
use serde::Serialize;
use std::path::PathBuf;
use trainable::Model;
use trainkit::hub::HubFiles;
use trainkit::inputs::{Input, Reads};
use trainkit::lora::{LoraArgs, Peft};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// BERT is a masked LM, for which PEFT has no task.
const PEFT: Peft = Peft { targets: &bert::LORA_TARGETS, task_type: None, fan_in_fan_out: false };

#[derive(clap::Parser, Debug)]
#[command(about = "Masked-LM training of BERT with activation checkpointing (candle + remat)")]
struct Args {
    /// tiny, base (110M), large (340M).
    #[arg(long, default_value = "base", conflicts_with_all = ["config", "model_id"])]
    preset: Preset,
    #[command(flatten)]
    pretrained: trainkit::hub::Pretrained,
    #[command(flatten)]
    run: trainkit::RunArgs,
    #[command(flatten)]
    setup: Setup,
    #[command(flatten)]
    lora: LoraArgs,
    /// The tokenizer.json for --text; default: the --model-id's, or one beside --config or --init.
    /// Without one, --text is read in whole words.
    #[arg(long, requires = "text")]
    tokenizer: Option<PathBuf>,
    /// A vocabulary file (one token per line, e.g. WordPiece vocab.txt) to read --text in whole
    /// words; default: the words of the text.
    #[arg(long, requires = "text", conflicts_with = "tokenizer")]
    vocab: Option<PathBuf>,
}

/// This trainer's flags that decide what a run computes: its training snapshots keep them.
#[derive(clap::Args, Debug, Serialize)]
struct Setup {
    /// The sequence length: of every sequence on the synthetic corpus, the longest with --text.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// A UTF-8 text file to train on, one document per line (a longer one is cut into several
    /// sequences; a batch is padded to its longest); default: the built-in synthetic corpus.
    #[arg(long)]
    #[serde(serialize_with = "trainkit::data_source")]
    text: Option<PathBuf>,
}

fn main() -> Result<()> {
    trainkit::main::<Args>()
}

impl trainkit::Recipe for Args {
    type Model = Bert;
    type Data = MlmData;
    const MODEL: &'static str = "BERT";
    const MODEL_FLAGS: &'static str = "--preset, --config or --model-id";

    fn defaults() -> trainkit::Defaults {
        let (steps, batch, optimizer, lr) = (20, 2, trainable::OptimizerKind::Adamw, 1e-4);
        let policy = remat::Policy::EveryN(2).into();
        trainkit::Defaults { policy, steps, batch, optimizer, lr }
    }

    fn flags(&self) -> trainkit::Flags<'_> {
        let (run, sources, lora) =
            (&self.run, self.pretrained.sources(), Some((&self.lora, &PEFT)));
        trainkit::Flags { run, sources, lora }
    }

    fn input_size(&self) -> (&'static str, usize) {
        ("--seq", self.setup.seq)
    }

    fn preset(&self) -> Config {
        self.preset.config()
    }

    fn check(&self, config: &Config) -> Result<()> {
        if self.setup.seq > config.max_position_embeddings {
            bail!(
                "--seq {} exceeds the model's max_position_embeddings ({})",
                self.setup.seq,
                config.max_position_embeddings
            );
        }
        Ok(())
    }

    /// The synthetic corpus, or `--text` through its tokenizer or in whole words.
    fn data(&self, config: &mut Config, hub: Option<&HubFiles>) -> Result<MlmData> {
        let (seq, seed) = (self.setup.seq, self.run.seed);
        let Some(path) = &self.setup.text else {
            return Ok(MlmData::synthetic(config.vocab_size, seq, seed)?);
        };
        let text = trainkit::read_text("--text", path)?;
        let beside = self.pretrained.beside();
        let tokenizer = match &self.vocab {
            Some(_) => None,
            None => trainkit::hub::tokenizer_file(self.tokenizer.as_deref(), hub, &beside),
        };
        if let Some(file) = tokenizer {
            let tokenizer = Tokenizer::from_file(&file)?;
            trainkit::say!("--text {}: tokenized by {}", path.display(), file.display());
            return MlmData::tokenized(&text, &tokenizer, config.vocab_size, seq, seed)
                .with_context(|| format!("--text {}", path.display()));
        }
        let vocab = match &self.vocab {
            Some(v) => {
                WordVocab::from_file(v).with_context(|| format!("--vocab {}", v.display()))?
            }
            None => WordVocab::build(&text),
        };
        if self.vocab.is_none() && (hub.is_some() || self.pretrained.init.init.is_some()) {
            trainkit::say!(
                "warning: --text is read in whole words of its own vocabulary, whose ids mean \
                 nothing to the pre-trained embeddings: give --tokenizer (or --vocab)"
            );
        }
        MlmData::words(&text, &vocab, config.vocab_size, seq, seed)
            .with_context(|| format!("--text {}", path.display()))
    }

    fn inputs(&self, model: &Bert, data: &MlmData, step: u64, n: usize) -> Result<Vec<Tensor>> {
        let device = model.params().device();
        Ok(model.inputs(&data.batch(step, n), device)?)
    }

    /// Planned for the longest batch the data can give (--text batches are padded to their own
    /// longest row).
    fn planned_inputs(&self, model: &Bert, data: &MlmData, n: usize) -> Result<Vec<Tensor>> {
        let device = model.params().device();
        Ok(model.inputs(&data.full_length_batch(0, n), device)?)
    }

    fn read_files(&self, hub: Option<&HubFiles>) -> Vec<Input> {
        let mut files =
            trainkit::inputs::given(&[("--text", &self.setup.text), ("--vocab", &self.vocab)]);
        if self.setup.text.is_some() && self.vocab.is_none() {
            let beside = self.pretrained.beside();
            let tokenizer = trainkit::hub::tokenizer_file(self.tokenizer.as_deref(), hub, &beside);
            files.extend(tokenizer.map(|p| Input::file("--text's tokenizer", &p, Reads::Setup)));
        }
        files
    }

    fn samples(&self, data: &MlmData) -> Option<usize> {
        Some(data.samples())
    }

    fn setup(&self, _: &Config) -> impl Serialize {
        &self.setup
    }

    fn describe(&self, model: &Bert, data: &MlmData, policy: &Policy, segments: &str) -> String {
        format!(
            "BERT {}, {} layers, policy {policy} ({segments}), batch {} x seq {}, vocabulary {}",
            model.params().count_text(),
            model.config.num_hidden_layers,
            self.run.batch,
            self.setup.seq,
            data.vocab_len
        )
    }
}
