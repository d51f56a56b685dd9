//! Finding a published BERT on the Hugging Face hub (or in its local cache).

use std::path::{Path, PathBuf};

/// Why a model's files could not be found or fetched.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("model `{model}` is not in the cache {cache} (offline: not downloading)")]
    NotCached { model: String, cache: String },
    #[error("fetching `{model}` from the Hugging Face hub: {source}")]
    Fetch { model: String, source: hf_hub::api::sync::ApiError },
}

/// Finds `config.json` and `model.safetensors` of a Hugging Face model id: in the local cache
/// first (`cache`, or the default `~/.cache/huggingface/hub`), else downloaded into it unless
/// `offline` (or `HF_HUB_OFFLINE=1`).
pub fn hub_files(model_id: &str, cache: Option<&Path>, offline: bool) -> Result<(PathBuf, PathBuf), HubError> {
    let offline = offline || std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| v == "1");
    let local = match cache {
        Some(dir) => hf_hub::Cache::new(dir.to_path_buf()),
        None => hf_hub::Cache::from_env(),
    };
    let repo = local.model(model_id.to_string());
    if let (Some(c), Some(w)) = (repo.get("config.json"), repo.get("model.safetensors")) {
        return Ok((c, w));
    }
    if offline {
        return Err(HubError::NotCached { model: model_id.to_string(), cache: local.path().display().to_string() });
    }
    let mut api = hf_hub::api::sync::ApiBuilder::new();
    if let Some(dir) = cache {
        api = api.with_cache_dir(dir.to_path_buf());
    }
    let fetch = |source| HubError::Fetch { model: model_id.to_string(), source };
    let remote = api.build().map_err(fetch)?.model(model_id.to_string());
    Ok((remote.get("config.json").map_err(fetch)?, remote.get("model.safetensors").map_err(fetch)?))
}
