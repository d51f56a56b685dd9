//! Reading a model's configuration file (a Hugging Face `config.json`): one reader, one error type
//! that names the file and what is wrong, for every model crate; and the error of a preset name
//! that is not one.

use std::path::Path;

/// A configuration file that cannot be read, parsed, or describes no valid model.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {reason}")]
pub struct ConfigError {
    pub path: String,
    /// What is wrong, naming the field where one is at fault.
    pub reason: String,
}

/// Reads the JSON file at `path` into `T` and checks it with `validate` (which names the field).
pub fn read_config<T: serde::de::DeserializeOwned>(
    path: &Path,
    validate: impl FnOnce(&T) -> Result<(), String>,
) -> Result<T, ConfigError> {
    let fail = |reason: String| ConfigError { path: path.display().to_string(), reason };
    let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
    let config: T = serde_json::from_str(&text).map_err(|e| fail(e.to_string()))?;
    validate(&config).map_err(fail)?;
    Ok(config)
}

/// A preset name a model does not have; the message lists the valid ones.
#[derive(Debug, thiserror::Error)]
#[error("unknown {model} preset `{given}`; valid presets: {}", valid.join(", "))]
pub struct UnknownPreset {
    pub model: &'static str,
    pub given: String,
    /// Each preset's name, with its size where it has one: `small (124M)`.
    pub valid: &'static [&'static str],
}

/// `FromStr` for a model's presets, from one table of names (each with its size, where it has
/// one): an unknown name is refused with an [`UnknownPreset`] that lists them all.
/// `trainable::presets!(Preset, "GPT-2", [Preset::Tiny => "tiny", Preset::Small => "small" ("124M")]);`
#[macro_export]
macro_rules! presets {
    ($ty:ty, $model:literal, [$($variant:path => $name:literal $(($size:literal))?),+ $(,)?]) => {
        impl std::str::FromStr for $ty {
            type Err = $crate::UnknownPreset;

            fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
                match s {
                    $($name => Ok($variant),)+
                    _ => Err($crate::UnknownPreset {
                        model: $model,
                        given: s.into(),
                        valid: &[$(concat!($name $(, " (", $size, ")")?)),+],
                    }),
                }
            }
        }
    };
}

/// A model's configuration as a run sets it, whatever the model: what the shared flags (`--dtype`,
/// `--freeze`, `--lora`) decide of it, and where it reads a `config.json` from. The training path
/// sets them here and nowhere else; a training snapshot keeps its fields (serialized: what the
/// shared flags set is kept as flags, and skipped). [`model_config!`](crate::model_config)
/// implements it.
pub trait ModelConfig: Clone + std::fmt::Debug + serde::Serialize + 'static {
    /// Reads a Hugging Face `config.json`; errors name the file and the field. Default: the model
    /// has none (its presets are its sizes).
    fn from_json(path: &Path) -> Result<Self, ConfigError> {
        let reason = "this model is configured by its presets, not by a config.json".into();
        Err(ConfigError { path: path.display().to_string(), reason })
    }

    /// The precision it computes in (`--dtype`).
    fn set_precision(&mut self, dtype: crate::Precision);

    /// The parameters that do not train (`--freeze`).
    fn set_freeze(&mut self, freeze: params::Freeze);

    /// The width of the layers LoRA adapts (a rank above it is refused); `None`: the model takes
    /// no adapters.
    fn lora_width(&self) -> Option<usize> {
        None
    }

    /// LoRA adapters on the layers `lora.targets` names, every base parameter frozen (`--lora`).
    /// A model that takes none ([`ModelConfig::lora_width`] is `None`) refuses them.
    fn set_lora(&mut self, lora: params::lora::Lora) -> Result<(), String> {
        let _ = lora;
        Err("this model takes no LoRA adapters".into())
    }
}

/// [`ModelConfig`] for a configuration struct whose fields `dtype` and `freeze` are what the shared
/// flags set; with `lora_width: FIELD`, also its `lora` (adapters of rank at most `FIELD`), and
/// with `validate: FN`, a Hugging Face `config.json` read into it ([`read_config`]) and checked by
/// `FN`. `trainable::model_config!(Config, lora_width: n_embd, validate: Config::validate);`
#[macro_export]
macro_rules! model_config {
    ($ty:ty $(, lora_width: $width:ident)? $(, validate: $validate:path)?) => {
        impl $crate::ModelConfig for $ty {
            $(
                fn from_json(path: &std::path::Path) -> std::result::Result<Self, $crate::ConfigError> {
                    $crate::read_config(path, $validate)
                }
            )?

            fn set_precision(&mut self, dtype: $crate::Precision) {
                self.dtype = dtype;
            }

            fn set_freeze(&mut self, freeze: params::Freeze) {
                self.freeze = freeze;
            }

            $(
                fn lora_width(&self) -> Option<usize> {
                    Some(self.$width)
                }

                fn set_lora(
                    &mut self,
                    lora: params::lora::Lora,
                ) -> std::result::Result<(), String> {
                    self.lora = Some(lora);
                    Ok(())
                }
            )?
        }
    };
}

/// The checks of a configuration's fields that every model shares, each failing with the
/// message that names the field (for [`read_config`]'s `validate`).
pub mod check {
    /// The largest size a configuration's field may have (2^31): beyond any model published,
    /// and low enough that the products of sizes a model computes (a weight's elements, a
    /// step's activations) cannot overflow before its footprint is checked.
    pub const MAX_SIZE: usize = 1 << 31;

    /// Each of `fields` (name, value) is in 1..=[`MAX_SIZE`].
    pub fn positive(fields: &[(&str, usize)]) -> Result<(), String> {
        match fields.iter().find(|(_, v)| !(1..=MAX_SIZE).contains(v)) {
            Some((name, v)) => Err(format!("{name} must be in 1..={MAX_SIZE}, got {v}")),
            None => Ok(()),
        }
    }

    /// `width` (name, value) splits into `heads` (name, value) heads of equal size.
    pub fn heads(width: (&str, usize), heads: (&str, usize)) -> Result<(), String> {
        if heads.1 == 0 || !width.1.is_multiple_of(heads.1) {
            return Err(format!(
                "{} ({}) must be a positive multiple of {} ({})",
                width.0, width.1, heads.0, heads.1
            ));
        }
        Ok(())
    }

    /// Each of `fields` (name, dropout probability) is in [0, 1).
    pub fn probabilities(fields: &[(&str, f32)]) -> Result<(), String> {
        match fields.iter().find(|(_, p)| !(0.0..1.0).contains(p)) {
            Some((name, p)) => Err(format!("{name} must be in [0, 1), got {p}")),
            None => Ok(()),
        }
    }

    /// A normalisation's epsilon `(name, value)` is a positive number.
    pub fn epsilon((name, eps): (&str, f64)) -> Result<(), String> {
        if !(eps.is_finite() && eps > 0.0) {
            return Err(format!("{name} must be a positive number, got {eps}"));
        }
        Ok(())
    }

    /// `key` (a `config.json` key of a variant the model does not implement) has one of the
    /// values it implements (`supported`, shown as JSON): another would be silently ignored.
    pub fn implemented<T: PartialEq + serde::Serialize>(
        key: &str,
        value: &T,
        supported: &[T],
    ) -> Result<(), String> {
        if supported.contains(value) {
            return Ok(());
        }
        let json = |v: &T| serde_json::to_string(v).unwrap_or_default();
        let supported: Vec<String> = supported.iter().map(json).collect();
        Err(format!(
            "{key} {} is not implemented by this model (supported: {})",
            json(value),
            supported.join(", ")
        ))
    }

    /// The LoRA adapters, where there are some.
    pub fn lora(lora: Option<&params::lora::Lora>) -> Result<(), String> {
        lora.map_or(Ok(()), params::lora::Lora::validate)
    }
}
