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
/// `model::presets!(Preset, "GPT-2", [Preset::Tiny => "tiny", Preset::Small => "small" ("124M")]);`
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
