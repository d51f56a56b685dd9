//! `train-unet3d`: train the 3D U-Net with activation checkpointing on synthetic or `.npy` volumes.

use anyhow::{bail, Result};
use candle_core::Tensor;
use clap::ValueEnum;
use datasets::volumes::{NpyVolumes, SyntheticVolumes};
use remat::memory::CountingAlloc;
use remat::Policy;
use serde::Serialize;
use std::path::PathBuf;
use trainable::Model;
use trainkit::inputs::{Input, Reads};
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
    trainkit::main::<Args>()
}

impl trainkit::Recipe for Args {
    type Model = UNet3d;
    type Data = Data;
    const MODEL: &'static str = "3D U-Net";
    const MODEL_FLAGS: &'static str = "--preset, --classes";

    fn defaults() -> trainkit::Defaults {
        let (steps, batch, optimizer, lr) = (20, 2, trainable::OptimizerKind::Adamw, 1e-3);
        let policy = remat::Policy::BeforeDownsample.into();
        trainkit::Defaults { policy, steps, batch, optimizer, lr }
    }

    fn flags(&self) -> trainkit::Flags<'_> {
        trainkit::Flags::run(&self.run)
    }

    fn input_size(&self) -> (&'static str, usize) {
        ("--volume", self.setup.volume)
    }

    /// The preset's, with one input channel until the data says otherwise (the step's floor is
    /// checked at one: a lower bound for data with more).
    fn preset(&self) -> Config {
        Config {
            classes: self.setup.classes,
            norm: self.setup.group_norm.map_or(Norm::Batch, Norm::Group),
            loss: match self.setup.loss {
                LossArg::Ce => Loss::CrossEntropy,
                LossArg::CeDice => Loss::CrossEntropyDice,
            },
            ..self.preset.config()
        }
    }

    fn check(&self, config: &Config) -> Result<()> {
        trainkit::args::check_classes(self.setup.classes)?;
        if self.setup.classes < 2 {
            bail!(
                "--classes must be at least 2 (with one class the loss is 0 and nothing is \
                 learned)"
            );
        }
        if config.norm == Norm::Batch {
            // The bottom of the U: the volume after `levels` poolings (a non-multiple of
            // 2^levels is refused when the model is built).
            let side = (self.setup.volume >> config.levels).max(1);
            let map = format!("{side}x{side}x{side}");
            trainkit::args::check_batch_norm(self.run.batch, side.saturating_pow(3), &map)?;
        }
        Ok(())
    }

    /// Synthetic shapes, or the folder's volumes, whose channels the model takes.
    fn data(&self, config: &mut Config, _: Option<&trainkit::hub::HubFiles>) -> Result<Data> {
        let Some(root) = &self.setup.data else {
            return Ok(Data::Synthetic(SyntheticVolumes::new(self.setup.volume, self.run.seed)));
        };
        let volumes = NpyVolumes::open(root, self.run.seed)?;
        volumes.check_labels(self.setup.classes as u32)?;
        let first = volumes.read(0)?;
        if first.shape[1..].iter().any(|&s| s != self.setup.volume) {
            bail!(
                "--volume {} does not match the data's volumes of shape {:?} (C, D, H, W)",
                self.setup.volume,
                first.shape
            );
        }
        config.in_channels = first.shape[0];
        Ok(Data::Npy(volumes))
    }

    fn read_files(&self, _: Option<&trainkit::hub::HubFiles>) -> Vec<Input> {
        let folder =
            |p: &PathBuf| Input::folder("--data", p, Reads::Setup, datasets::volumes::listed);
        self.setup.data.iter().map(folder).collect()
    }

    fn inputs(&self, model: &UNet3d, data: &Data, step: u64, n: usize) -> Result<Vec<Tensor>> {
        let device = model.params().device();
        let (voxels, labels) = match data {
            Data::Synthetic(d) => d.batch(step, n),
            Data::Npy(d) => {
                let (_, v, l) = d.batch(step, n)?;
                (v, l)
            }
        };
        if let Some(&bad) = labels.iter().find(|&&l| l as usize >= self.setup.classes) {
            bail!("label {bad} is outside --classes {}", self.setup.classes);
        }
        Ok(model.inputs(&voxels, &labels, self.setup.volume, device)?)
    }

    fn batch_names<'a>(&'a self, data: &'a Data) -> Option<trainkit::recipe::BatchNames<'a>> {
        let Data::Npy(volumes) = data else { return None };
        Some(Box::new(move |step, per_step| volumes.files(step, per_step).join(", ")))
    }

    fn samples(&self, data: &Data) -> Option<usize> {
        match data {
            Data::Synthetic(_) => None,
            Data::Npy(volumes) => Some(volumes.len()),
        }
    }

    fn setup(&self, _: &Config) -> impl Serialize {
        &self.setup
    }

    fn describe(&self, model: &UNet3d, _: &Data, policy: &Policy, segments: &str) -> String {
        format!(
            "3D U-Net {}, policy {policy} ({segments}), batch {} x {}^3",
            model.params().count_text(),
            self.run.batch,
            self.setup.volume
        )
    }
}
