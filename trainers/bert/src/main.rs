//! `train-bert`: masked-LM training of BERT with activation checkpointing.

use anyhow::{bail, Context, Result};
use bert::{Bert, Config, MlmData, Preset};
use datasets::text::WordVocab;
use datasets::tokenizer::Tokenizer;
use model::{Benchable, Model};
use remat::memory::CountingAlloc;
use serde::Serialize;
use std::path::PathBuf;
use trainkit::lora::LoraSetup;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// BERT is a masked LM, for which PEFT has no task.
const PEFT: trainkit::lora::Peft =
    trainkit::lora::Peft { targets: &bert::LORA_TARGETS, task_type: None, fan_in_fan_out: false };

#[derive(clap::Parser, Debug)]
#[command(about = "Masked-LM training of BERT with activation checkpointing (candle + remat)")]
struct Args {
    /// tiny, base (110M), large (340M).
    #[arg(long, default_value = "base", conflicts_with_all = ["config", "model_id"])]
    preset: Preset,
    /// A Hugging Face config.json (instead of --preset).
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(flatten)]
    hub: trainkit::hub::HubArgs,
    #[command(flatten)]
    init: trainkit::hub::InitArgs,
    #[command(flatten)]
    run: trainkit::RunArgs,
    #[command(flatten)]
    setup: Setup,
    #[command(flatten)]
    lora: trainkit::lora::LoraArgs,
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
    let defaults = trainkit::Defaults {
        policy: "every-two-blocks",
        steps: "20",
        batch: "2",
        optimizer: "adamw",
        lr: "1e-4",
    };
    trainkit::main(defaults, |args: &Args| &args.run, train)
}

/// One rank's training (the only one, without data parallelism).
fn train(args: &Args, group: &trainkit::Group, device: &candle_core::Device) -> Result<()> {
    let hub = args.hub.files()?;
    let config = match trainkit::hub::config_file(args.config.as_deref(), hub.as_ref()) {
        Some(path) => Config::from_json(path)?,
        None => args.preset.config(),
    };
    let lora = args.lora.config(&PEFT, config.hidden_size)?;
    let config = Config {
        dtype: args.run.dtype,
        freeze: args.run.freeze.clone().unwrap_or_default(),
        lora: lora.clone(),
        ..config
    };
    if args.setup.seq > config.max_position_embeddings {
        bail!(
            "--seq {} exceeds the model's max_position_embeddings ({})",
            args.setup.seq,
            config.max_position_embeddings
        );
    }
    let (what, elements) = Bert::step_floor(&config, args.run.batch, args.setup.seq);
    trainkit::check_footprint("--batch x --seq", what, elements)?;
    let data = data(args, &config, hub.as_ref())?;
    let model = trainkit::build_model("--preset, --config or --model-id", || {
        Ok(Bert::new(config, device, args.run.seed)?)
    })?;
    args.init.load(&model, hub.as_ref())?;
    args.lora.prepare(lora.as_ref(), &model, PEFT.targets)?;
    let inputs = |step: u64, n: usize| -> Result<Vec<candle_core::Tensor>> {
        Ok(model.inputs(&data.batch(step, n), device)?)
    };
    // Planned for the longest batch the data can give (--text batches are padded to their own
    // longest row).
    let longest = |n: usize| -> Result<Vec<candle_core::Tensor>> {
        Ok(model.inputs(&data.full_length_batch(0, n), device)?)
    };
    let trainer = trainkit::Trainer {
        run: &args.run,
        group,
        model: &model,
        sizes: format!("--batch {} x --seq {}", args.run.batch, args.setup.seq),
        setup: (&args.setup, lora.as_ref().map(LoraSetup::from)),
        outputs: args.lora.outputs(),
        planned_inputs: Some(&longest),
        batch_names: None,
    };
    trainer.run(&inputs, |policy, segments| {
        format!(
            "BERT {}, {} layers, policy {policy} ({segments}), batch {} x seq {}, vocabulary {}",
            model.params().count_text(),
            model.config.num_hidden_layers,
            args.run.batch,
            args.setup.seq,
            data.vocab_len
        )
    })?;
    // PEFT names the base model by its hub id; a model from a preset or a config.json has none.
    let base_model = args.hub.model_id.as_deref().unwrap_or_default();
    args.lora.save(lora.as_ref(), &model, (base_model, &PEFT), group)
}

/// The synthetic corpus, or `--text` through its tokenizer or in whole words.
fn data(args: &Args, config: &Config, hub: Option<&trainkit::hub::HubFiles>) -> Result<MlmData> {
    let Some(path) = &args.setup.text else {
        return Ok(MlmData::synthetic(config.vocab_size, args.setup.seq, args.run.seed)?);
    };
    let text = trainkit::read_text("--text", path)?;
    let tokenizer = match &args.vocab {
        Some(_) => None,
        None => trainkit::hub::tokenizer_file(
            args.tokenizer.as_deref(),
            hub,
            &[args.config.as_deref(), args.init.init.as_deref()],
        ),
    };
    let (seq, seed) = (args.setup.seq, args.run.seed);
    if let Some(file) = tokenizer {
        let tokenizer = Tokenizer::from_file(&file)?;
        trainkit::say!("--text {}: tokenized by {}", path.display(), file.display());
        return MlmData::tokenized(&text, &tokenizer, config.vocab_size, seq, seed)
            .with_context(|| format!("--text {}", path.display()));
    }
    let vocab = match &args.vocab {
        Some(v) => WordVocab::from_file(v).with_context(|| format!("--vocab {}", v.display()))?,
        None => WordVocab::build(&text),
    };
    if args.vocab.is_none() && (hub.is_some() || args.init.init.is_some()) {
        trainkit::say!(
            "warning: --text is read in whole words of its own vocabulary, whose ids mean nothing \
             to the pre-trained embeddings: give --tokenizer (or --vocab)"
        );
    }
    MlmData::words(&text, &vocab, config.vocab_size, seq, seed)
        .with_context(|| format!("--text {}", path.display()))
}
