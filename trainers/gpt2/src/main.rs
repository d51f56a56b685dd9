//! `train-gpt2`: train GPT-2 with activation checkpointing on the default corpus, a text file or a
//! token file.

use anyhow::{bail, Context, Result};
use datasets::tokenizer::Tokenizer;
use datasets::tokens::Batcher;
use gpt2::{Config, Gpt2, Preset};
use model::{Benchable, Model};
use remat::memory::CountingAlloc;
use serde::Serialize;
use std::path::PathBuf;
use trainkit::lora::LoraSetup;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// GPT-2 stores its projections (in, out): torch's `Conv1D`.
const PEFT: trainkit::lora::Peft = trainkit::lora::Peft {
    targets: &gpt2::LORA_TARGETS,
    task_type: Some("CAUSAL_LM"),
    fan_in_fan_out: true,
};

#[derive(clap::Parser, Debug)]
#[command(about = "Train GPT-2 with activation checkpointing (candle + remat)")]
struct Args {
    /// Model size: tiny, small (124M), medium (350M), large (774M), xl (1.56B).
    #[arg(long, default_value = "small", conflicts_with_all = ["config", "model_id"])]
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
    #[arg(long, requires = "text")]
    tokenizer: Option<PathBuf>,
}

/// This trainer's flags that decide what a run computes: its training snapshots keep them.
#[derive(clap::Args, Debug, Serialize)]
struct Setup {
    /// Sequence length (at most the model's context).
    #[arg(long, default_value_t = 256)]
    seq: usize,
    /// Flat u16 little-endian token file; default: the built-in synthetic corpus (byte tokens).
    #[arg(long, conflicts_with = "text")]
    #[serde(serialize_with = "trainkit::data_source")]
    data: Option<PathBuf>,
    /// A UTF-8 text file to train on, tokenized whole and packed into full sequences.
    #[arg(long)]
    #[serde(serialize_with = "trainkit::data_source")]
    text: Option<PathBuf>,
}

fn main() -> Result<()> {
    let defaults = trainkit::Defaults {
        policy: "sqrt",
        steps: "50",
        batch: "2",
        optimizer: "adamw",
        lr: "6e-4",
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
    let lora = args.lora.config(&PEFT, config.n_embd)?;
    let config = Config {
        dtype: args.run.dtype,
        freeze: args.run.freeze.clone().unwrap_or_default(),
        lora: lora.clone(),
        ..config
    };
    if args.setup.seq == 0 || args.setup.seq > config.n_positions {
        bail!(
            "--seq {} is out of range: the model's context is 1..={} positions",
            args.setup.seq,
            config.n_positions
        );
    }
    let (what, elements) = Gpt2::step_floor(&config, args.run.batch, args.setup.seq);
    trainkit::check_footprint("--batch x --seq", what, elements)?;
    // The parameters and their gradients, from the configuration: a config.json of 100000 layers
    // is refused now, not after building a model the machine cannot hold.
    let params = <Gpt2 as model::Benchable>::parameter_shapes(&config)?
        .iter()
        .map(|s| s.iter().map(|&d| d as u128).product::<u128>())
        .sum::<u128>();
    trainkit::check_footprint(
        "--preset, --config or --model-id",
        "the memory of the parameters and their gradients",
        params.checked_mul(2),
    )?;
    let tokens = match (&args.setup.data, &args.setup.text) {
        (Some(path), _) => datasets::tokens::load_u16(path)?,
        (None, Some(path)) => text_tokens(args, path, hub.as_ref())?,
        (None, None) => {
            datasets::text::byte_tokens(&datasets::text::synthetic_corpus(args.run.seed, 1 << 20))
        }
    };
    let batcher = Batcher::new(tokens, args.setup.seq, config.vocab_size, args.run.seed)
        .context(if args.setup.text.is_some() { "--text" } else { "--data" })?;

    let model = trainkit::build_model("--preset, --config or --model-id", || {
        Ok(Gpt2::new(config, device, args.run.seed)?)
    })?;
    args.init.load(&model, hub.as_ref())?;
    args.lora.prepare(lora.as_ref(), &model, PEFT.targets)?;
    let inputs = |step: u64, n: usize| {
        let (x, y) = batcher.batch(step, n);
        Ok(model.inputs(&x, &y, n, args.setup.seq, device)?)
    };
    let trainer = trainkit::Trainer {
        run: &args.run,
        group,
        model: &model,
        sizes: format!("--batch {} x --seq {}", args.run.batch, args.setup.seq),
        setup: (&args.setup, lora.as_ref().map(LoraSetup::from)),
        outputs: args.lora.outputs(),
        planned_inputs: None,
        batch_names: None,
    };
    trainer.run(&inputs, |policy, segments| {
        format!(
            "GPT-2 {}, {} layers, policy {policy} ({segments}), batch {} x seq {}",
            model.params().count_text(),
            model.config.n_layer,
            args.run.batch,
            args.setup.seq
        )
    })?;
    // PEFT names the base model by its hub id; a model from a preset or a config.json has none.
    let base_model = args.hub.model_id.as_deref().unwrap_or_default();
    args.lora.save(lora.as_ref(), &model, (base_model, &PEFT), group)
}

/// `--text` through its tokenizer, as one token stream.
fn text_tokens(
    args: &Args,
    path: &std::path::Path,
    hub: Option<&trainkit::hub::HubFiles>,
) -> Result<Vec<u16>> {
    let text = trainkit::read_text("--text", path)?;
    let Some(file) = trainkit::hub::tokenizer_file(
        args.tokenizer.as_deref(),
        hub,
        &[args.config.as_deref(), args.init.init.as_deref()],
    ) else {
        bail!(
            "--text needs a tokenizer: give --tokenizer tokenizer.json (or put one beside --config \
             or --init)"
        );
    };
    let ids = Tokenizer::from_file(&file)?.encode(&text)?;
    trainkit::say!("--text {}: {} tokens by {}", path.display(), ids.len(), file.display());
    datasets::tokens::narrow_u16(&ids).with_context(|| format!("--text {}", path.display()))
}
