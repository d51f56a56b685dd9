//! `train-unet3d`: train the 3D U-Net with activation checkpointing on synthetic or `.npy` volumes.

use anyhow::{bail, Result};
use clap::ValueEnum;
use datasets::volumes::{NpyVolumes, SyntheticVolumes};
use model::{Benchable, Model};
use remat::memory::CountingAlloc;
use serde::Serialize;
use std::path::PathBuf;
use unet3d::{Config, Loss, Norm, Preset, UNet3d};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[derive(Clone, Copy, Debug, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum LossArg {
    Ce,
    CeDice,
}

#[derive(clap::Parser, Debug)]
#[command(about = "Train a 3D U-Net with activation checkpointing (candle + remat)")]
struct Args {
    /// tiny, small (16-32-64-128), cicek (32-64-128-256, 512 at the bottom).
    #[arg(long, default_value = "small")]
    preset: Preset,
    #[command(flatten)]
    run: trainkit::RunArgs,
    #[command(flatten)]
    setup: Setup,
}

/// This trainer's flags that decide what a run computes: its training snapshots keep them.
#[derive(clap::Args, Debug, Serialize)]
struct Setup {
    /// Side of the cubic input volume (a multiple of 2^levels).
    #[arg(long, default_value_t = 32)]
    volume: usize,
    /// Classes of the labels (3 for the synthetic shapes).
    #[arg(long, default_value_t = 3)]
    classes: usize,
    /// GroupNorm with this many groups instead of BatchNorm.
    #[arg(long)]
    group_norm: Option<usize>,
    #[arg(long, value_enum, default_value = "ce")]
    loss: LossArg,
    /// A folder with images/*.npy (C, D, H, W) and labels/*.npy (D, H, W); default: synthetic
    /// shapes.
    #[arg(long)]
    #[serde(serialize_with = "trainkit::data_source")]
    data: Option<PathBuf>,
}

enum Data {
    Synthetic(SyntheticVolumes),
    Npy(NpyVolumes),
}

fn main() -> Result<()> {
    let defaults = trainkit::Defaults {
        policy: "before-downsample",
        steps: "20",
        batch: "2",
        optimizer: "adamw",
        lr: "1e-3",
    };
    trainkit::main(defaults, |args: &Args| &args.run, train)
}

/// One rank's training (the only one, without data parallelism).
fn train(args: &Args, group: &trainkit::Group, device: &candle_core::Device) -> Result<()> {
    if args.setup.classes < 2 {
        bail!("--classes must be at least 2 (with one class the loss is 0 and nothing is learned)");
    }
    // Before the data, at the preset's one input channel: a lower bound for data with more.
    let (what, elements) =
        UNet3d::step_floor(&args.preset.config(), args.run.batch, args.setup.volume);
    trainkit::check_footprint("--batch x --volume", what, elements)?;
    let (data, in_channels) = match &args.setup.data {
        Some(root) => {
            let volumes = NpyVolumes::open(root, args.run.seed)?;
            volumes.check_labels(args.setup.classes as u32)?;
            let first = volumes.read(0)?;
            if first.shape[1..].iter().any(|&s| s != args.setup.volume) {
                bail!(
                    "--volume {} does not match the data's volumes of shape {:?} (C, D, H, W)",
                    args.setup.volume,
                    first.shape
                );
            }
            (Data::Npy(volumes), first.shape[0])
        }
        None => (Data::Synthetic(SyntheticVolumes::new(args.setup.volume, args.run.seed)), 1),
    };
    let config = Config {
        in_channels,
        classes: args.setup.classes,
        norm: args.setup.group_norm.map_or(Norm::Batch, Norm::Group),
        loss: match args.setup.loss {
            LossArg::Ce => Loss::CrossEntropy,
            LossArg::CeDice => Loss::CrossEntropyDice,
        },
        dtype: args.run.dtype,
        freeze: args.run.freeze.clone().unwrap_or_default(),
        ..args.preset.config()
    };
    let model = trainkit::build_model("--preset, --classes", || {
        Ok(UNet3d::new(config, device, args.run.seed)?)
    })?;
    let inputs = |step: u64, n: usize| -> Result<Vec<candle_core::Tensor>> {
        let (voxels, labels) = match &data {
            Data::Synthetic(d) => d.batch(step, n),
            Data::Npy(d) => {
                let (_, v, l) = d.batch(step, n)?;
                (v, l)
            }
        };
        if let Some(&bad) = labels.iter().find(|&&l| l as usize >= args.setup.classes) {
            bail!("label {bad} is outside --classes {}", args.setup.classes);
        }
        Ok(model.inputs(&voxels, &labels, args.setup.volume, device)?)
    };
    let per_step = args.run.batch * group.world();
    let trainer = trainkit::Trainer {
        run: &args.run,
        group,
        model: &model,
        sizes: format!("--batch {} x --volume {}", args.run.batch, args.setup.volume),
        setup: &args.setup,
        outputs: Vec::new(),
        planned_inputs: None,
        batch_names: match &data {
            Data::Npy(volumes) => Some(Box::new(move |n| volumes.files(n, per_step).join(", "))),
            Data::Synthetic(_) => None,
        },
    };
    trainer.run(&inputs, |policy, segments| {
        format!(
            "3D U-Net {}, policy {policy} ({segments}), batch {} x {}^3",
            model.params().count_text(),
            args.run.batch,
            args.setup.volume
        )
    })
}
