//! `--lora R` and its companions, for the trainers whose models take LoRA adapters (GPT-2,
//! BERT): the adapters' configuration from the flags, the checks, and what is written after
//! training (the adapter in PEFT's layout, the merged weights).

use anyhow::{bail, Context, Result};
use model::Model;
use params::lora::{self, Lora, PeftModel};
use serde::Serialize;
use std::path::PathBuf;

/// The flags that decide what a LoRA run computes, as its training snapshots keep them (a resume
/// must match them): the adapters' configuration, defaults resolved.
#[derive(Serialize)]
pub struct LoraSetup {
    lora: usize,
    lora_alpha: f64,
    lora_dropout: f32,
    lora_targets: String,
}

impl From<&Lora> for LoraSetup {
    fn from(l: &Lora) -> Self {
        LoraSetup {
            lora: l.rank,
            lora_alpha: l.alpha,
            lora_dropout: l.dropout,
            lora_targets: l.targets.join(","),
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct LoraArgs {
    /// Fine-tune with LoRA adapters of rank R (PEFT's: A Kaiming-uniform, B zeros) beside the
    /// --lora-targets layers; every base parameter is frozen: no gradient computed or stored.
    #[arg(long, conflicts_with = "freeze")]
    pub lora: Option<usize>,
    /// The adapters' update is scaled by alpha / R (PEFT's `lora_alpha`; default R: a scale of 1).
    #[arg(long, requires = "lora")]
    pub lora_alpha: Option<f64>,
    /// Dropout on the adapters' input (PEFT's `lora_dropout`), keyed like every dropout.
    #[arg(long, requires = "lora", default_value_t = 0.0)]
    pub lora_dropout: f32,
    /// The layers that get adapters, comma-separated, matched as PEFT's `target_modules`: a
    /// layer's name or its last components. Default: every attention and MLP projection.
    #[arg(long, requires = "lora", value_delimiter = ',')]
    pub lora_targets: Vec<String>,
    /// Start from the adapter in this folder (PEFT's layout: --save-adapter's, or PEFT's own).
    #[arg(long, requires = "lora", conflicts_with = "resume")]
    pub load_adapter: Option<PathBuf>,
    /// After training, write the adapter to this folder as PEFT does (`adapter_model.safetensors`,
    /// `adapter_config.json`): `PeftModel.from_pretrained(base, folder)` loads it.
    #[arg(long, requires = "lora", conflicts_with = "dry_run")]
    pub save_adapter: Option<PathBuf>,
    /// After training, write the base weights with the adapters merged in (W + alpha/R B A) as a
    /// snapshot, which --init loads into the model without --lora.
    #[arg(long, requires = "lora", conflicts_with = "dry_run")]
    pub save_merged: Option<PathBuf>,
}

impl LoraArgs {
    /// The adapters' configuration, `default_targets` where --lora-targets is not given; a
    /// rank above `width`, the narrowest side of the layers adapted, is refused.
    pub fn config(&self, default_targets: &[&str], width: usize) -> Result<Option<Lora>> {
        let Some(rank) = self.lora else { return Ok(None) };
        if rank > width {
            bail!(
                "--lora {rank} is above the width {width} of the layers it adapts: an update of a \
                 layer that wide has rank at most {width}"
            );
        }
        let targets = if self.lora_targets.is_empty() {
            default_targets.iter().map(|t| t.to_string()).collect()
        } else {
            self.lora_targets.clone()
        };
        let lora = Lora {
            rank,
            alpha: self.lora_alpha.unwrap_or(rank as f64),
            dropout: self.lora_dropout,
            targets,
            init_lora_weights: true,
        };
        lora.validate().map_err(anyhow::Error::msg).context("--lora")?;
        Ok(Some(lora))
    }

    /// The paths `--save-merged` and `--save-adapter` write, for the check of every output
    /// before training.
    pub fn outputs(&self) -> Vec<crate::snapshot::Output<'_>> {
        use crate::snapshot::Output;
        let merged = self.save_merged.as_deref().map(|p| Output::File("--save-merged", p));
        let adapter = self
            .save_adapter
            .as_deref()
            .map(|d| Output::Folder("--save-adapter", d, &lora::ADAPTER_FILES));
        merged.into_iter().chain(adapter).collect()
    }

    /// Before training: every target names a layer that got an adapter (a typo would adapt
    /// nothing, or less than asked); then --load-adapter.
    pub fn prepare(
        &self,
        lora: Option<&Lora>,
        model: &impl Model,
        adaptable: &[&str],
    ) -> Result<()> {
        let Some(lora) = lora else { return Ok(()) };
        let names: Vec<&str> = model
            .params()
            .named()
            .filter_map(|(n, _)| n.strip_suffix(&format!(".{}", lora::LORA_A)))
            .collect();
        let unmatched = lora.unmatched_targets(&names);
        if !unmatched.is_empty() {
            bail!(
                "--lora-targets {}: matches no layer this model adapts (its layers: {})",
                unmatched.join(","),
                adaptable.join(", ")
            );
        }
        if let Some(dir) = &self.load_adapter {
            model.load_adapter(dir).context("--load-adapter")?;
            crate::say!("adapter from {}", dir.display());
        }
        Ok(())
    }

    /// After training, on the first rank: the adapter and the merged weights, where asked.
    pub fn save(
        &self,
        lora: Option<&Lora>,
        model: &impl Model,
        peft: (&str, Option<&str>, bool),
        group: &crate::Group,
    ) -> Result<()> {
        let Some(lora) = lora.filter(|_| group.is_root()) else { return Ok(()) };
        if let Some(dir) = &self.save_adapter {
            let (base_model, task_type, fan_in_fan_out) = peft;
            let model_info = PeftModel {
                base_model,
                task_type,
                fan_in_fan_out,
                published_name: &|n| model.published_name(n),
            };
            lora::save_adapter(dir, model.params(), lora, &model_info).context("--save-adapter")?;
            crate::say!("saved adapter to {}", dir.display());
        }
        if let Some(path) = &self.save_merged {
            let merged = model.params().merged().context("--save-merged")?;
            params::write_snapshot(path, &merged, Default::default())
                .with_context(|| format!("--save-merged {}", path.display()))?;
            crate::say!("saved merged weights to {}", path.display());
        }
        Ok(())
    }
}
