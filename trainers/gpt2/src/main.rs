//! `train-gpt2`: train GPT-2 with activation checkpointing on the default corpus or a token file.

use anyhow::{bail, Context, Result};
use clap::Parser;
use datasets::tokens::Batcher;
use gpt2::{Config, Gpt2, Preset};
use layers::Model;
use remat::memory::CountingAlloc;
use remat::Policy;
use std::path::PathBuf;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[derive(Parser, Debug)]
#[command(about = "Train GPT-2 with activation checkpointing (candle + remat)")]
struct Args {
    /// Model size: tiny, small (124M), medium (350M), large (774M), xl (1.56B).
    #[arg(long, default_value = "small")]
    preset: Preset,
    /// A Hugging Face config.json; overrides --preset.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Checkpointing policy: off, sqrt, every-two-blocks, every-n=K, explicit=I,J,...,
    /// budget=SIZE (the plan with the least recompute that fits SIZE, model state included), auto
    #[arg(long, default_value = "sqrt")]
    policy: Policy,
    #[arg(long, default_value_t = 50)]
    steps: usize,
    #[arg(long, default_value_t = 2)]
    batch: usize,
    /// Sequence length (at most the model's context).
    #[arg(long, default_value_t = 256)]
    seq: usize,
    #[command(flatten)]
    run: trainkit::RunArgs,
    /// Flat u16 little-endian token file; default: the built-in synthetic corpus (byte tokens).
    #[arg(long)]
    data: Option<PathBuf>,
    /// sgd, adamw or adafactor.
    #[arg(long, default_value = "adamw")]
    optimizer: layers::OptimizerKind,
    #[arg(long, default_value_t = 6e-4)]
    lr: f64,
    /// Start from these weights (Hugging Face GPT-2 safetensors).
    #[arg(long)]
    init: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    trainkit::check_lr(args.lr)?;
    let config = match &args.config {
        Some(path) => Config::from_json(path)?,
        None => args.preset.config(),
    };
    let config = Config { dtype: args.run.dtype, ..config };
    if args.seq == 0 || args.seq > config.n_positions {
        bail!("--seq {} is out of range: the model's context is 1..={} positions", args.seq, config.n_positions);
    }
    if args.batch == 0 || args.steps == 0 {
        bail!("--batch and --steps must be at least 1");
    }
    let logits = (args.batch as u128).checked_mul(args.seq as u128).and_then(|n| n.checked_mul(config.vocab_size as u128));
    trainkit::check_footprint("--batch x --seq", "the logits", logits)?;
    let tokens = match &args.data {
        Some(path) => datasets::tokens::load_u16(path)?,
        None => datasets::text::byte_tokens(&datasets::text::synthetic_corpus(args.run.seed, 1 << 20)),
    };
    let batcher = Batcher::new(tokens, args.seq, config.vocab_size, args.run.seed).context("--data")?;

    let device = trainkit::device(&args.run.device)?;
    let model = Gpt2::new(config, &device, args.run.seed)?;
    if let Some(path) = &args.init {
        model.load_snapshot(path)?;
    }
    let mut opt = args.optimizer.build(model.params().vars(), args.lr)?;
    let inputs = |step: u64, n: usize| {
        let (x, y) = batcher.batch(step, n);
        Ok(model.inputs(&x, &y, n, args.seq, &device)?)
    };
    let Some((exec, policy)) = trainkit::executor(&args.run, &args.policy, &model, opt.as_ref(), args.batch, &|n| inputs(0, n))? else {
        return Ok(());
    };
    trainkit::say!(
        "GPT-2 {} params, {} layers, policy {} ({} segments), batch {} x seq {}",
        model.params().count(),
        model.config.n_layer,
        policy,
        exec.segments().len(),
        args.batch,
        args.seq
    );

    let mut log = trainkit::StepLog::new(args.steps, args.batch, &args.run)?;
    let start = log.resume(model.params(), opt.as_mut())?;
    let batch = |step: u64| inputs(step, args.batch);
    for step in start..args.steps {
        log.train_step(&exec, step, batch, |g| opt.update(g))?;
        log.eval_if_due(step, &model, batch)?;
        log.save_if_due(step, model.params(), opt.as_ref(), |p| Ok(model.save_snapshot(p)?))?;
    }
    log.finish();
    Ok(())
}
