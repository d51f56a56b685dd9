//! `train-resnet`: train a ResNet with activation checkpointing on synthetic images or an image
//! folder.

use anyhow::{bail, Result};
use candle_core::Tensor;
use datasets::images::{ImageFolder, SyntheticImages};
use remat::memory::CountingAlloc;
use remat::Policy;
use resnet::{Config, Preset, ResNet};
use serde::Serialize;
use std::path::PathBuf;
use trainable::Model;
use trainkit::inputs::{Input, Reads};

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
    trainkit::main::<Args>()
}

impl trainkit::Recipe for Args {
    type Model = ResNet;
    type Data = Data;
    const MODEL: &'static str = "ResNet";
    const MODEL_FLAGS: &'static str = "--preset, --classes";

    fn defaults() -> trainkit::Defaults {
        let (steps, batch, optimizer, lr) = (20, 8, trainable::OptimizerKind::Sgd, 0.05);
        let policy = remat::Policy::BeforeDownsample.into();
        trainkit::Defaults { policy, steps, batch, optimizer, lr }
    }

    fn flags(&self) -> trainkit::Flags<'_> {
        let sources = trainkit::Sources { init: Some(&self.init), ..Default::default() };
        trainkit::Flags { sources, ..trainkit::Flags::run(&self.run) }
    }

    fn input_size(&self) -> (&'static str, usize) {
        ("--image-size", self.image_size)
    }

    fn preset(&self) -> Config {
        self.preset.config()
    }

    fn check(&self, _: &Config) -> Result<()> {
        trainkit::args::check_classes(self.classes)?;
        if self.image_size < 32 {
            bail!(
                "--image-size {} is too small: ResNet downsamples 32x, use at least 32",
                self.image_size
            );
        }
        let side = resnet::last_map_side(self.image_size);
        trainkit::args::check_batch_norm(self.run.batch, side * side, &format!("{side}x{side}"))
    }

    /// Synthetic images of --classes, or the folder's, whose sub-folders are the classes.
    fn data(&self, config: &mut Config, _: Option<&trainkit::hub::HubFiles>) -> Result<Data> {
        let (data, classes) = match &self.data {
            Some(root) => {
                let folder = ImageFolder::open(root, self.image_size, self.run.seed)?;
                let n = folder.classes().len();
                (Data::Folder(folder), n)
            }
            None => (
                Data::Synthetic(SyntheticImages::new(self.classes, self.image_size, self.run.seed)),
                self.classes,
            ),
        };
        if classes < 2 {
            let why = "with one class the loss is 0 and nothing is learned";
            match &self.data {
                Some(root) => bail!(
                    "--data {}: {classes} class folder; training needs at least 2 ({why})",
                    root.display()
                ),
                None => bail!("--classes must be at least 2 ({why})"),
            }
        }
        config.classes = classes;
        Ok(data)
    }

    fn read_files(&self, _: Option<&trainkit::hub::HubFiles>) -> Vec<Input> {
        let folder =
            |p: &PathBuf| Input::folder("--data", p, Reads::Setup, datasets::images::listed);
        self.data.iter().map(folder).collect()
    }

    fn inputs(&self, model: &ResNet, data: &Data, step: u64, n: usize) -> Result<Vec<Tensor>> {
        let device = model.params().device();
        let (images, labels) = data.batch(step, n)?;
        Ok(model.inputs(&images, &labels, self.image_size, device)?)
    }

    fn samples(&self, data: &Data) -> Option<usize> {
        match data {
            Data::Synthetic(_) => None,
            Data::Folder(folder) => Some(folder.images()),
        }
    }

    fn setup(&self, config: &Config) -> impl Serialize {
        Setup { image_size: self.image_size, classes: config.classes, data: self.data.clone() }
    }

    fn describe(&self, model: &ResNet, _: &Data, policy: &Policy, segments: &str) -> String {
        let size = self.image_size;
        format!(
            "ResNet {}, {} blocks, policy {policy} ({segments}), batch {} x {size}x{size}, \
             {} classes",
            model.params().count_text(),
            model.graph().blocks().len(),
            self.run.batch,
            model.config.classes
        )
    }
}
