//! `--lora R` and its companions, for the trainers whose models take LoRA adapters (GPT-2,
//! BERT): the adapters' configuration from the flags, the checks, and what is written after
//! training (the adapter in PEFT's layout, the merged weights).

use anyhow::{anyhow, bail, Context, Result};
use params::lora::{self, Lora, PeftModel};
use serde::Serialize;
use std::collections::BTreeSet;
use std::fmt::Display;
use std::path::{Path, PathBuf};
use trainable::Model;

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

/// What PEFT knows of a model's adaptable layers beside their names.
pub struct Peft {
    /// The layers adapted where --lora-targets is not given.
    pub targets: &'static [&'static str],
    /// PEFT's `task_type`: `CAUSAL_LM` (GPT-2); none for a masked LM, which PEFT has no task for.
    pub task_type: Option<&'static str>,
    /// Whether the layers store their weight (in, out) (GPT-2's `Conv1D`): PEFT's
    /// `fan_in_fan_out`.
    pub fan_in_fan_out: bool,
}

#[derive(clap::Args, Debug)]
#[command(group = clap::ArgGroup::new("lora_on").args(["lora", "load_adapter"]).multiple(true))]
pub struct LoraArgs {
    /// Fine-tune with LoRA adapters of rank R (PEFT's: A Kaiming-uniform, B zeros) beside the
    /// --lora-targets layers; every base parameter is frozen: no gradient computed or stored.
    #[arg(long, conflicts_with = "freeze")]
    pub lora: Option<usize>,
    /// The adapters' update is scaled by alpha / R (PEFT's `lora_alpha`; default R: a scale of 1).
    #[arg(long, requires = "lora_on")]
    pub lora_alpha: Option<f64>,
    /// Dropout on the adapters' input (PEFT's `lora_dropout`; default 0), keyed like every
    /// dropout.
    #[arg(long, requires = "lora_on")]
    pub lora_dropout: Option<f32>,
    /// The layers that get adapters, comma-separated, matched as PEFT's `target_modules`: a
    /// layer's name or its last components. Default: every attention and MLP projection.
    #[arg(long, requires = "lora_on", value_delimiter = ',')]
    pub lora_targets: Vec<String>,
    /// Fine-tune from the adapter in this folder (PEFT's layout: --save-adapter's, or PEFT's
    /// own), as its `adapter_config.json` says (rank, alpha, dropout, targets); a --lora* flag
    /// given as well must agree with it.
    #[arg(long, conflicts_with_all = ["resume", "freeze"])]
    pub load_adapter: Option<PathBuf>,
    /// After training, write the adapter to this folder as PEFT does (`adapter_model.safetensors`,
    /// `adapter_config.json`): `PeftModel.from_pretrained(base, folder)` loads it.
    #[arg(long, requires = "lora_on", conflicts_with = "dry_run")]
    pub save_adapter: Option<PathBuf>,
    /// After training, write the base weights with the adapters merged in (W + alpha/R B A) as a
    /// snapshot, which --init loads into the model without --lora.
    #[arg(long, requires = "lora_on", conflicts_with = "dry_run")]
    pub save_merged: Option<PathBuf>,
}

impl LoraArgs {
    /// The adapters' configuration: --load-adapter's, else from the flags (`peft.targets` where
    /// --lora-targets is not given). A rank above `width`, the narrowest side of the layers
    /// adapted, is refused.
    pub fn config(&self, peft: &Peft, width: usize) -> Result<Option<Lora>> {
        let lora = match (&self.load_adapter, self.lora) {
            (Some(dir), _) => self.agree_with_adapter(dir, peft)?,
            (None, None) => return Ok(None),
            (None, Some(rank)) => Lora {
                rank,
                alpha: self.lora_alpha.unwrap_or(rank as f64),
                dropout: self.lora_dropout.unwrap_or(0.0),
                targets: if self.lora_targets.is_empty() {
                    peft.targets.iter().map(|t| t.to_string()).collect()
                } else {
                    self.lora_targets.clone()
                },
                init_lora_weights: true,
            },
        };
        if lora.rank > width {
            bail!(
                "--lora {} is above the width {width} of the layers it adapts: an update of a \
                 layer that wide has rank at most {width}",
                lora.rank
            );
        }
        lora.validate().map_err(anyhow::Error::msg).context("--lora")?;
        Ok(Some(lora))
    }

    /// The adapter's configuration as `dir`'s `adapter_config.json` says; a flag that says
    /// otherwise is refused, naming both values.
    fn agree_with_adapter(&self, dir: &Path, peft: &Peft) -> Result<Lora> {
        let saved = lora::read_adapter_config(dir).context("--load-adapter")?;
        let config = dir.join(lora::ADAPTER_FILES[1]);
        let contradiction = |flag: &str, given: &dyn Display, key: &str, value: &dyn Display| {
            anyhow!(
                "{flag} {given} contradicts the adapter's `{key}` {value} in {}: leave {flag} out \
                 to take the adapter's",
                config.display()
            )
        };
        let lora = saved.lora;
        if let Some(rank) = self.lora.filter(|&r| r != lora.rank) {
            return Err(contradiction("--lora", &rank, "r", &lora.rank));
        }
        if let Some(alpha) = self.lora_alpha.filter(|&a| a != lora.alpha) {
            return Err(contradiction("--lora-alpha", &alpha, "lora_alpha", &lora.alpha));
        }
        if let Some(dropout) = self.lora_dropout.filter(|&d| d != lora.dropout) {
            return Err(contradiction("--lora-dropout", &dropout, "lora_dropout", &lora.dropout));
        }
        let set = |names: &[String]| names.iter().cloned().collect::<BTreeSet<String>>();
        if !self.lora_targets.is_empty() && set(&self.lora_targets) != set(&lora.targets) {
            let (given, saved) = (self.lora_targets.join(","), lora.targets.join(","));
            return Err(contradiction("--lora-targets", &given, "target_modules", &saved));
        }
        if saved.fan_in_fan_out != peft.fan_in_fan_out {
            crate::say!(
                "--load-adapter: {} says fan_in_fan_out {}, but this model's layers store their \
                 weight {}: taken as {}, as PEFT does",
                config.display(),
                saved.fan_in_fan_out,
                if peft.fan_in_fan_out { "(in, out)" } else { "(out, in)" },
                peft.fan_in_fan_out
            );
        }
        Ok(lora)
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
            let flag = match self.load_adapter {
                Some(_) => "--load-adapter's target_modules",
                None => "--lora-targets",
            };
            bail!(
                "{flag} {}: matches no layer this model adapts (its layers: {})",
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
        (base_model, peft): (&str, &Peft),
        group: &crate::Group,
    ) -> Result<()> {
        let Some(lora) = lora.filter(|_| group.is_root()) else { return Ok(()) };
        if let Some(dir) = &self.save_adapter {
            let model_info = PeftModel {
                base_model,
                task_type: peft.task_type,
                fan_in_fan_out: peft.fan_in_fan_out,
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
