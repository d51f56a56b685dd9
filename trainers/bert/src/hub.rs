//! Finding a published BERT on the Hugging Face hub (or in its local cache).

use std::path::Path;

/// Finds `config.json` and `model.safetensors` of a Hugging Face model id: in the local cache
/// first (`cache`, or the default `~/.cache/huggingface/hub`), else downloaded into it unless
/// `offline` (or `HF_HUB_OFFLINE=1`).
pub fn hub_files(model_id: &str, cache: Option<&Path>, offline: bool) -> anyhow::Result<(std::path::PathBuf, std::path::PathBuf)> {
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
        anyhow::bail!("model `{model_id}` is not in the cache {} (offline: not downloading)", local.path().display());
    }
    let mut api = hf_hub::api::sync::ApiBuilder::new();
    if let Some(dir) = cache {
        api = api.with_cache_dir(dir.to_path_buf());
    }
    let remote = api.build()?.model(model_id.to_string());
    Ok((remote.get("config.json")?, remote.get("model.safetensors")?))
}
