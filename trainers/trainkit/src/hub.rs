//! Where a run's pre-trained weights come from: a Hugging Face model id (the local cache, or
//! downloaded into it) or a local snapshot, loaded with the task head initialised where the
//! snapshot lacks it; and the `tokenizer.json` that goes with them.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use trainable::Model;

/// Why a model's files could not be found or fetched.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("model `{model}` is not in the cache {cache} (offline: not downloading)")]
    NotCached { model: String, cache: String },
    #[error("fetching `{model}` from the Hugging Face hub: {source}")]
    Fetch { model: String, source: hf_hub::api::sync::ApiError },
    #[error("the model's sharded checkpoint: {0}")]
    Index(String),
}

/// A published model's files.
#[derive(Clone, Debug)]
pub struct HubFiles {
    pub config: PathBuf,
    pub weights: PathBuf,
    /// `tokenizer.json`, where the model publishes one.
    pub tokenizer: Option<PathBuf>,
}

/// Whether a model's files missing from the cache may be downloaded (`--offline`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Download {
    Allowed,
    /// The cache only: a model not in it is an error.
    Never,
}

/// Finds `config.json`, `model.safetensors` (or a sharded checkpoint's index and its shards) and
/// `tokenizer.json` (optional) of a Hugging Face
/// model id: in the local cache first (`cache`, or the default `~/.cache/huggingface/hub`), else
/// downloaded into it where `download` allows (and `HF_HUB_OFFLINE=1` does not forbid it).
pub fn hub_files(
    model_id: &str,
    cache: Option<&Path>,
    download: Download,
) -> Result<HubFiles, HubError> {
    let offline =
        download == Download::Never || std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| v == "1");
    let local = match cache {
        Some(dir) => hf_hub::Cache::new(dir.to_path_buf()),
        None => hf_hub::Cache::from_env(),
    };
    let repo = local.model(model_id.to_string());
    // One file, or a sharded checkpoint's index whose shards are all cached too.
    let cached_weights = repo.get(WEIGHTS).or_else(|| {
        let index = repo.get(INDEX)?;
        let shards = params::shards(&index).ok()?;
        shards.iter().all(|s| s.is_file()).then_some(index)
    });
    if let (Some(config), Some(weights)) = (repo.get("config.json"), cached_weights) {
        return Ok(HubFiles { config, weights, tokenizer: repo.get("tokenizer.json") });
    }
    if offline {
        return Err(HubError::NotCached {
            model: model_id.to_string(),
            cache: local.path().display().to_string(),
        });
    }
    let mut api = hf_hub::api::sync::ApiBuilder::new();
    if let Some(dir) = cache {
        api = api.with_cache_dir(dir.to_path_buf());
    }
    let fetch = |source| HubError::Fetch { model: model_id.to_string(), source };
    let remote = api.build().map_err(fetch)?.model(model_id.to_string());
    let weights = match remote.get(WEIGHTS) {
        Ok(file) => file,
        // Sharded: the index, then each shard it names, into the same snapshot folder.
        Err(single) => {
            let index = remote.get(INDEX).map_err(|_| fetch(single))?;
            let shards = params::shards(&index).map_err(|e| HubError::Index(e.to_string()))?;
            for shard in shards {
                let name = shard.file_name().unwrap_or_default().to_string_lossy();
                remote.get(&name).map_err(fetch)?;
            }
            index
        }
    };
    Ok(HubFiles {
        config: remote.get("config.json").map_err(fetch)?,
        weights,
        tokenizer: remote.get("tokenizer.json").ok(),
    })
}

/// A model's weights in one file, and the index of a sharded checkpoint's.
const WEIGHTS: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

/// Makes the folder of `model_id` in the hub cache `cache`, the layout `hf-hub` reads (a `main`
/// ref to a snapshot), and returns it: files put there resolve offline as if downloaded. For a
/// machine without network, and for tests, which must not download.
pub fn cache_folder(cache: &Path, model_id: &str) -> std::io::Result<PathBuf> {
    let repo = cache.join(format!("models--{}", model_id.replace('/', "--")));
    std::fs::create_dir_all(repo.join("refs"))?;
    std::fs::write(repo.join("refs/main"), "local")?;
    let snapshot = repo.join("snapshots/local");
    std::fs::create_dir_all(&snapshot)?;
    Ok(snapshot)
}

/// The options of trainers that can start from a published model on the Hugging Face hub.
#[derive(clap::Args, Debug)]
pub struct HubArgs {
    /// A Hugging Face model id (e.g. bert-base-uncased, gpt2): its config.json, model.safetensors
    /// and tokenizer.json, from the cache or downloaded into it.
    #[arg(long, conflicts_with_all = ["config", "init"])]
    pub model_id: Option<String>,
    /// The Hugging Face cache folder (default: ~/.cache/huggingface/hub).
    #[arg(long)]
    pub hub_cache: Option<PathBuf>,
    /// Never download (also: HF_HUB_OFFLINE=1).
    #[arg(long)]
    pub offline: bool,
}

impl HubArgs {
    /// The model's files, if `--model-id` names one.
    pub fn files(&self) -> Result<Option<HubFiles>> {
        // Checked here, not by clap: clap waives `requires` whenever `--preset` (which conflicts
        // with --model-id) is given.
        let Some(id) = &self.model_id else {
            if self.hub_cache.is_some() || self.offline {
                bail!("--hub-cache and --offline apply to --model-id, which was not given");
            }
            return Ok(None);
        };
        let download = if self.offline { Download::Never } else { Download::Allowed };
        Ok(Some(hub_files(id, self.hub_cache.as_deref(), download)?))
    }
}

/// The `config.json` a model is built from: `--config`'s, else the `--model-id`'s; `None`: the
/// preset's configuration.
pub fn config_file<'a>(config: Option<&'a Path>, hub: Option<&'a HubFiles>) -> Option<&'a Path> {
    config.or(hub.map(|files| files.config.as_path()))
}

/// Where a model's configuration and weights may come from besides its presets.
#[derive(Clone, Copy, Default)]
pub struct Sources<'a> {
    /// `--config`: a Hugging Face `config.json`.
    pub config: Option<&'a Path>,
    /// `--model-id` and its companions.
    pub hub: Option<&'a HubArgs>,
    /// `--init` and `--strict`.
    pub init: Option<&'a InitArgs>,
}

/// Where a published model comes from, for the trainers that read Hugging Face configurations
/// (GPT-2, BERT): `--config`, `--model-id` and `--init`.
#[derive(clap::Args, Debug)]
pub struct Pretrained {
    /// A Hugging Face config.json (instead of --preset).
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub hub: HubArgs,
    #[command(flatten)]
    pub init: InitArgs,
}

impl Pretrained {
    /// All three, as the training path reads them.
    pub fn sources(&self) -> Sources<'_> {
        Sources { config: self.config.as_deref(), hub: Some(&self.hub), init: Some(&self.init) }
    }

    /// The files a `tokenizer.json` may lie beside: `--config` and `--init`.
    pub fn beside(&self) -> [Option<&Path>; 2] {
        [self.config.as_deref(), self.init.init.as_deref()]
    }
}

/// The options of every trainer that can start from pre-trained weights.
#[derive(clap::Args, Debug)]
pub struct InitArgs {
    /// Start from these weights: a safetensors snapshot under the published names (Hugging Face,
    /// torchvision). A task head the snapshot lacks, or has for another number of classes, is
    /// initialised instead, and the log names it. Not with --resume, whose training snapshot
    /// holds the weights to continue from.
    #[arg(long, conflicts_with = "resume")]
    pub init: Option<PathBuf>,
    /// Refuse weights that lack part of the model (the task head) instead of initialising it.
    #[arg(long)]
    pub strict: bool,
}

impl InitArgs {
    /// Loads `--init`, or else the hub model's weights, into `model`, and says what it
    /// initialised instead of loading.
    pub fn load(&self, model: &impl Model, hub: Option<&HubFiles>) -> Result<()> {
        let path = match (&self.init, hub) {
            (Some(path), _) => path,
            (None, Some(files)) => &files.weights,
            (None, None) if self.strict => bail!(
                "--strict applies to pre-trained weights, and none were given (--init or \
                 --model-id)"
            ),
            (None, None) => return Ok(()),
        };
        let fresh = model.init_from(path, self.strict);
        if let Err(e @ params::SnapshotError::Adapters { .. }) = fresh {
            return Err(anyhow::Error::new(e).context(
                "--init of a LoRA run's snapshot: give --lora (and --lora-targets) as that run \
                 did, or --init the weights it wrote with --save-merged",
            ));
        }
        let fresh = fresh.with_context(|| match self.strict {
            true => {
                "--strict: the weights must hold every parameter (without --strict the task head \
                 is initialised)"
            }
            false => "loading pre-trained weights",
        })?;
        crate::say!("weights from {}", path.display());
        if !fresh.is_empty() {
            let names: Vec<String> = fresh.iter().map(ToString::to_string).collect();
            crate::say!(
                "initialised, not loaded ({} task-head tensors): {}",
                fresh.len(),
                names.join(", ")
            );
        }
        Ok(())
    }
}

/// The `tokenizer.json` of a run: `explicit` (`--tokenizer`), else the hub model's, else one in
/// the folder of any of `beside` (the `--config` and `--init` files).
pub fn tokenizer_file(
    explicit: Option<&Path>,
    hub: Option<&HubFiles>,
    beside: &[Option<&Path>],
) -> Option<PathBuf> {
    if let Some(path) = explicit {
        return Some(path.to_path_buf());
    }
    if let Some(path) = hub.and_then(|h| h.tokenizer.clone()) {
        return Some(path);
    }
    beside
        .iter()
        .flatten()
        .filter_map(|p| Some(p.parent()?.join("tokenizer.json")))
        .find(|p| p.is_file())
}
