//! `train-unet3d`: train the 3D U-Net with activation checkpointing on synthetic or `.npy` volumes.

use anyhow::{bail, Result};
use clap::{Parser, ValueEnum};
use datasets::volumes::{NpyVolumes, SyntheticVolumes};
use model::Model;
use remat::memory::CountingAlloc;
use remat::PolicyRequest;
use std::path::PathBuf;
use unet3d::{Config, Loss, Norm, Preset, UNet3d};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LossArg {
    Ce,
    CeDice,
}

#[derive(Parser, Debug)]
#[command(about = "Train a 3D U-Net with activation checkpointing (candle + remat)")]
struct Args {
    /// tiny, small (16-32-64-128), cicek (32-64-128-256, 512 at the bottom).
    #[arg(long, default_value = "small")]
    preset: Preset,
    /// off, sqrt, every-two-blocks, before-downsample, every-n=K, explicit=I,J,..., budget=SIZE
    /// (the plan with the least recompute that fits SIZE, model state included), auto
    #[arg(long, default_value = "before-downsample")]
    policy: PolicyRequest,
    #[arg(long, default_value_t = 2)]
    batch: usize,
    /// Side of the cubic input volume (a multiple of 2^levels).
    #[arg(long, default_value_t = 32)]
    volume: usize,
    #[arg(long, default_value_t = 20)]
    steps: usize,
    #[command(flatten)]
    run: trainkit::RunArgs,
    /// A folder with images/*.npy (C, D, H, W) and labels/*.npy (D, H, W); default: synthetic shapes.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Classes of the labels (3 for the synthetic shapes).
    #[arg(long, default_value_t = 3)]
    classes: usize,
    /// GroupNorm with this many groups instead of BatchNorm.
    #[arg(long)]
    group_norm: Option<usize>,
    #[arg(long, value_enum, default_value = "ce")]
    loss: LossArg,
    /// sgd, adamw or adafactor.
    #[arg(long, default_value = "adamw")]
    optimizer: model::OptimizerKind,
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
}

enum Data {
    Synthetic(SyntheticVolumes),
    Npy(NpyVolumes),
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
    let volumes = (args.batch as u128).checked_mul((args.volume as u128).checked_pow(3).unwrap_or(u128::MAX));
    trainkit::check_footprint("--batch x --volume", "the input volumes", volumes)?;
    let (data, in_channels) = match &args.data {
        Some(root) => {
            let volumes = NpyVolumes::open(root, args.run.seed)?;
            let first = volumes.read(0)?;
            if first.shape[1..].iter().any(|&s| s != args.volume) {
                bail!("--volume {} does not match the data's volumes of shape {:?} (C, D, H, W)", args.volume, first.shape);
            }
            (Data::Npy(volumes), first.shape[0])
        }
        None => (Data::Synthetic(SyntheticVolumes::new(args.volume, args.run.seed)), 1),
    };
    let config = Config {
        in_channels,
        classes: args.classes,
        norm: args.group_norm.map_or(Norm::Batch, Norm::Group),
        loss: match args.loss {
            LossArg::Ce => Loss::CrossEntropy,
            LossArg::CeDice => Loss::CrossEntropyDice,
        },
        dtype: args.run.dtype,
        freeze: args.run.freeze.clone().unwrap_or_default(),
        ..args.preset.config()
    };
    let model = trainkit::build_model("--preset, --classes", || Ok(UNet3d::new(config, device, args.run.seed)?))?;
    let inputs = |step: u64, n: usize| -> Result<Vec<candle_core::Tensor>> {
        let (voxels, labels) = match &data {
            Data::Synthetic(d) => d.batch(step, n),
            Data::Npy(d) => {
                let (_, v, l) = d.batch(step, n)?;
                (v, l)
            }
        };
        if let Some(&bad) = labels.iter().find(|&&l| l as usize >= args.classes) {
            bail!("label {bad} is outside --classes {}", args.classes);
        }
        Ok(model.inputs(&voxels, &labels, args.volume, device)?)
    };
    let per_step = args.batch * group.world();
    let trainer = trainkit::Trainer {
        run: &args.run,
        group,
        model: &model,
        policy: &args.policy,
        optimizer: args.optimizer,
        lr: args.lr,
        steps: args.steps,
        batch: args.batch,
        sizes: format!("--batch {} x --volume {}", args.batch, args.volume),
        fields: vec![
            ("--volume", args.volume.to_string()),
            ("--classes", args.classes.to_string()),
            ("--group-norm", args.group_norm.map_or("not given".into(), |g| g.to_string())),
            ("--loss", format!("{:?}", args.loss).to_lowercase()),
            ("--optimizer", args.optimizer.to_string()),
            ("--lr", args.lr.to_string()),
        ],
        planned_inputs: None,
        batch_names: match &data {
            Data::Npy(volumes) => Some(Box::new(move |n| volumes.files(n, per_step).join(", "))),
            Data::Synthetic(_) => None,
        },
    };
    trainer.run(&inputs, |policy, segments| {
        format!("3D U-Net {}, policy {policy} ({segments}), batch {} x {}^3", model.params().count_text(), args.batch, args.volume)
    })
}
