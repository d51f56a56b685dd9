//! `train-resnet`: train a ResNet with activation checkpointing on synthetic images or an image
//! folder.

use anyhow::{bail, Result};
use datasets::images::{ImageFolder, SyntheticImages};
use model::{Benchable, Model};
use remat::memory::CountingAlloc;
use resnet::{Config, Preset, ResNet};
use serde::Serialize;
use std::path::PathBuf;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[derive(clap::Parser, Debug)]
#[command(about = "Train a ResNet with activation checkpointing (candle + remat)")]
struct Args {
    /// tiny, resnet18, resnet34, resnet50, resnet101, resnet152.
    #[arg(long, default_value = "resnet50")]
    preset: Preset,
    /// Side of the square input images (at least 32).
    #[arg(long, default_value_t = 64)]
    image_size: usize,
    #[command(flatten)]
    run: trainkit::RunArgs,
    /// An image folder (one sub-folder per class, the ImageFolder layout); default: synthetic
    /// images.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Classes of the synthetic data (with --data, the folder's sub-folders are the classes).
    #[arg(long, default_value_t = 10, conflicts_with = "data")]
    classes: usize,
    #[command(flatten)]
    init: trainkit::hub::InitArgs,
}

/// This trainer's flags that decide what a run computes (the classes: the data folder's where
/// there is one): its training snapshots keep them.
#[derive(Serialize)]
struct Setup {
    image_size: usize,
    classes: usize,
    #[serde(serialize_with = "trainkit::data_source")]
    data: Option<PathBuf>,
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
    let defaults = trainkit::Defaults {
        policy: "before-downsample",
        steps: "20",
        batch: "8",
        optimizer: "sgd",
        lr: "0.05",
    };
    trainkit::main(defaults, |args: &Args| &args.run, train)
}

/// One rank's training (the only one, without data parallelism).
fn train(args: &Args, group: &trainkit::Group, device: &candle_core::Device) -> Result<()> {
    // Before the data (synthetic images are drawn at --image-size): the floor is the input
    // images, whatever the classes.
    let (what, elements) =
        ResNet::step_floor(&args.preset.config(), args.run.batch, args.image_size);
    trainkit::check_footprint("--batch x --image-size", what, elements)?;
    if args.image_size < 32 {
        bail!(
            "--image-size {} is too small: ResNet downsamples 32x, use at least 32",
            args.image_size
        );
    }
    let (data, classes) = match &args.data {
        Some(root) => {
            let folder = ImageFolder::open(root, args.image_size, args.run.seed)?;
            let n = folder.classes().len();
            (Data::Folder(folder), n)
        }
        None => (
            Data::Synthetic(SyntheticImages::new(args.classes, args.image_size, args.run.seed)),
            args.classes,
        ),
    };
    if classes < 2 {
        let why = "with one class the loss is 0 and nothing is learned";
        match &args.data {
            Some(root) => bail!(
                "--data {}: {classes} class folder; training needs at least 2 ({why})",
                root.display()
            ),
            None => bail!("--classes must be at least 2 ({why})"),
        }
    }
    let config = Config {
        classes,
        dtype: args.run.dtype,
        freeze: args.run.freeze.clone().unwrap_or_default(),
        ..args.preset.config()
    };
    let model = trainkit::build_model("--preset, --classes", || {
        Ok(ResNet::new(config, device, args.run.seed)?)
    })?;
    args.init.load(&model, None)?;
    let inputs = |step: u64, n: usize| {
        let (images, labels) = data.batch(step, n)?;
        Ok(model.inputs(&images, &labels, args.image_size, device)?)
    };
    let trainer = trainkit::Trainer {
        run: &args.run,
        group,
        model: &model,
        sizes: format!("--batch {} x --image-size {}", args.run.batch, args.image_size),
        setup: Setup { image_size: args.image_size, classes, data: args.data.clone() },
        outputs: Vec::new(),
        planned_inputs: None,
        batch_names: None,
    };
    trainer.run(&inputs, |policy, segments| {
        let size = args.image_size;
        format!(
            "ResNet {}, {} blocks, policy {policy} ({segments}), batch {} x {size}x{size}, \
             {classes} classes",
            model.params().count_text(),
            model.graph().blocks().len(),
            args.run.batch
        )
    })
}
