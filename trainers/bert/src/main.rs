//! `train-bert`: masked-LM training of BERT with activation checkpointing.

use anyhow::{bail, Context, Result};
use bert::{Bert, Config, MlmData, Preset};
use clap::Parser;
use datasets::text::WordVocab;
use layers::Model;
use remat::memory::CountingAlloc;
use remat::Policy;
use std::path::PathBuf;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[derive(Parser, Debug)]
#[command(about = "Masked-LM training of BERT with activation checkpointing (candle + remat)")]
struct Args {
    /// tiny, base (110M), large (340M).
    #[arg(long, default_value = "base")]
    preset: Preset,
    /// A Hugging Face config.json; overrides --preset.
    #[arg(long)]
    config: Option<PathBuf>,
    /// A Hugging Face model id (e.g. bert-base-uncased): its config and weights, from the cache
    /// or downloaded into it.
    #[arg(long)]
    model_id: Option<String>,
    /// The Hugging Face cache folder (default: ~/.cache/huggingface/hub).
    #[arg(long)]
    hub_cache: Option<PathBuf>,
    /// Never download (also: HF_HUB_OFFLINE=1).
    #[arg(long)]
    offline: bool,
    /// off, sqrt, every-two-blocks, every-n=K, explicit=I,J,..., budget=SIZE (the plan with the
    /// least recompute that fits SIZE, model state included), auto
    #[arg(long, default_value = "every-two-blocks")]
    policy: Policy,
    #[arg(long, default_value_t = 2)]
    batch: usize,
    #[arg(long, default_value_t = 128)]
    seq: usize,
    #[arg(long, default_value_t = 20)]
    steps: usize,
    #[command(flatten)]
    run: trainkit::RunArgs,
    /// A UTF-8 text file to train on; default: the built-in synthetic corpus.
    #[arg(long)]
    data: Option<PathBuf>,
    /// A vocabulary file (one token per line, e.g. WordPiece vocab.txt) for --data; default: the
    /// words of the data. Refused without --data: the synthetic corpus has its own vocabulary.
    #[arg(long, requires = "data")]
    vocab: Option<PathBuf>,
    /// sgd, adamw or adafactor.
    #[arg(long, default_value = "adamw")]
    optimizer: layers::OptimizerKind,
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    trainkit::check_lr(args.lr)?;
    if args.batch == 0 || args.steps == 0 {
        bail!("--batch and --steps must be at least 1");
    }
    let hub = match &args.model_id {
        Some(id) => Some(bert::hub_files(id, args.hub_cache.as_deref(), args.offline)?),
        None => None,
    };
    let config = match (&args.config, &hub) {
        (Some(path), _) | (None, Some((path, _))) => Config::from_json(path)?,
        (None, None) => args.preset.config(),
    };
    let config = Config { dtype: args.run.dtype, ..config };
    if args.seq > config.max_position_embeddings {
        bail!("--seq {} exceeds the model's max_position_embeddings ({})", args.seq, config.max_position_embeddings);
    }
    let hidden = (args.batch as u128).checked_mul(args.seq as u128).and_then(|n| n.checked_mul(config.hidden_size as u128));
    trainkit::check_footprint("--batch x --seq", "one layer's hidden states", hidden)?;
    let data = match &args.data {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("--data {}", path.display()))?;
            let vocab = match &args.vocab {
                Some(v) => WordVocab::from_file(v).with_context(|| format!("--vocab {}", v.display()))?,
                None => WordVocab::build(&text),
            };
            MlmData::new(&text, vocab, config.vocab_size, args.seq, args.run.seed)?
        }
        None => MlmData::synthetic(config.vocab_size, args.seq, args.run.seed)?,
    };
    let device = trainkit::device(&args.run.device)?;
    let model = Bert::new(config, &device, args.run.seed)?;
    if let Some((_, weights)) = &hub {
        model.load_snapshot(weights)?;
    }
    let mut opt = args.optimizer.build(model.params().vars(), args.lr)?;
    let inputs = |step: u64, n: usize| Ok(model.inputs(&data.batch(step, n), n, args.seq, &device)?);
    let Some((exec, policy)) = trainkit::executor(&args.run, &args.policy, &model, opt.as_ref(), args.batch, &|n| inputs(0, n))? else {
        return Ok(());
    };
    trainkit::say!(
        "BERT {} params, {} layers, policy {} ({} segments), batch {} x seq {}, vocabulary {}",
        model.params().count(),
        model.config.num_hidden_layers,
        policy,
        exec.segments().len(),
        args.batch,
        args.seq,
        data.vocab.len()
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
