//! `train-resnet`: train a ResNet with activation checkpointing on synthetic images or an image folder.

use anyhow::{bail, Result};
use clap::Parser;
use datasets::images::{ImageFolder, SyntheticImages};
use model::Model;
use remat::memory::CountingAlloc;
use remat::PolicyRequest;
use resnet::{Config, Preset, ResNet};
use std::path::PathBuf;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[derive(Parser, Debug)]
#[command(about = "Train a ResNet with activation checkpointing (candle + remat)")]
struct Args {
    /// tiny, resnet18, resnet34, resnet50, resnet101, resnet152.
    #[arg(long, default_value = "resnet50")]
    preset: Preset,
    /// off, sqrt, every-two-blocks, before-downsample, every-n=K, explicit=I,J,..., budget=SIZE
    /// (the plan with the least recompute that fits SIZE, model state included), auto
    #[arg(long, default_value = "before-downsample")]
    policy: PolicyRequest,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Side of the square input images (at least 32).
    #[arg(long, default_value_t = 64)]
    image_size: usize,
    #[arg(long, default_value_t = 20)]
    steps: usize,
    #[command(flatten)]
    run: trainkit::RunArgs,
    /// An image folder (one sub-folder per class, the ImageFolder layout); default: synthetic images.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Classes of the synthetic data (with --data, the folder's sub-folders are the classes).
    #[arg(long, default_value_t = 10, conflicts_with = "data")]
    classes: usize,
    /// sgd, adamw or adafactor.
    #[arg(long, default_value = "sgd")]
    optimizer: model::OptimizerKind,
    #[arg(long, default_value_t = 0.05)]
    lr: f64,
    #[command(flatten)]
    init: trainkit::hub::InitArgs,
}

/// Where batches come from.
enum Data {
    Synthetic(SyntheticImages),
    Folder(ImageFolder),
}

impl Data {
    fn batch(&self, step: u64, n: usize) -> Result<(Vec<f32>, Vec<u32>)> {
        Ok(match self {
            Data::Synthetic(d) => d.batch(step, n),
            Data::Folder(d) => d.batch(step, n)?,
        })
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let Some((group, device)) = trainkit::launch(&args.run)? else { return Ok(()) };
    trainkit::or_abort(&group, train(&args, &group, &device))
}

/// One rank's training (the only one, without data parallelism).
fn train(args: &Args, group: &trainkit::Group, device: &candle_core::Device) -> Result<()> {
    trainkit::check_lr(args.lr)?;
    if args.classes < 2 {
        bail!("--classes must be at least 2 (with one class the loss is 0 and nothing is learned)");
    }
    if args.batch == 0 || args.steps == 0 {
        bail!("--batch and --steps must be at least 1");
    }
    let images = (args.batch as u128).checked_mul(3).and_then(|n| n.checked_mul((args.image_size as u128).checked_pow(2)?));
    trainkit::check_footprint("--batch x --image-size", "the input images", images)?;
    if args.image_size < 32 {
        bail!("--image-size {} is too small: ResNet downsamples 32x, use at least 32", args.image_size);
    }
    let (data, classes) = match &args.data {
        Some(root) => {
            let folder = ImageFolder::open(root, args.image_size, args.run.seed)?;
            let n = folder.classes().len();
            (Data::Folder(folder), n)
        }
        None => (Data::Synthetic(SyntheticImages::new(args.classes, args.image_size, args.run.seed)), args.classes),
    };
    let config = Config { classes, dtype: args.run.dtype, freeze: args.run.freeze.clone().unwrap_or_default(), ..args.preset.config() };
    let model = trainkit::build_model("--preset, --classes", || Ok(ResNet::new(config, device, args.run.seed)?))?;
    args.init.load(&model, None)?;
    let inputs = |step: u64, n: usize| {
        let (images, labels) = data.batch(step, n)?;
        Ok(model.inputs(&images, &labels, args.image_size, device)?)
    };
    let trainer = trainkit::Trainer {
        run: &args.run,
        group,
        model: &model,
        policy: &args.policy,
        optimizer: args.optimizer,
        lr: args.lr,
        steps: args.steps,
        batch: args.batch,
        sizes: format!("--batch {} x --image-size {}", args.batch, args.image_size),
        fields: vec![
            ("--image-size", args.image_size.to_string()),
            ("--classes", classes.to_string()),
            ("--optimizer", args.optimizer.to_string()),
            ("--lr", args.lr.to_string()),
        ],
        planned_inputs: None,
        batch_names: None,
    };
    trainer.run(&inputs, |policy, segments| {
        let size = args.image_size;
        format!(
            "ResNet {}, {} blocks, policy {policy} ({segments}), batch {} x {size}x{size}, {classes} classes",
            model.params().count_text(),
            model.graph().blocks().len(),
            args.batch
        )
    })
}
