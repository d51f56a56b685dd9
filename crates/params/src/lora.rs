//! LoRA (Hu et al., 2021) as Hugging Face PEFT builds it: beside a frozen linear layer `W`, a
//! trained low-rank update `B A` scaled by `alpha / r`, with `A` (r, in) Kaiming-uniform and `B`
//! (out, r) zeros, so training starts from the base model's function. Every base parameter is
//! frozen ([`Lora::freeze`]): it gets no gradient, neither computed nor stored.
//!
//! The adapter of layer `h.0.attn.c_attn` is the parameters `h.0.attn.c_attn.lora_A.weight` and
//! `.lora_B.weight`; [`save_adapter`] writes them in PEFT's layout (`adapter_model.safetensors`
//! under `base_model.model.<published layer name>`, and `adapter_config.json`), which
//! `PeftModel.from_pretrained` loads, and [`load_adapter`] reads such a folder back.
//! [`ParamStore::merged`] folds the adapters into the base weights.
//!
//! Not here: which layers a model offers (its crate), the command-line flags (`trainkit`).

use crate::store::{
    read_snapshot, write_atomically, write_snapshot, AdapterInfo, Freeze, Init, ParamStore,
    SnapshotError,
};
use crate::WeightLayout;
use candle_core::{DType, Result, Tensor};
use std::collections::HashMap;
use std::path::Path;

/// The suffixes of an adapter's two parameters, after the layer's name.
pub const LORA_A: &str = "lora_A.weight";
pub const LORA_B: &str = "lora_B.weight";

/// The files of an adapter folder, as PEFT names them: the weights and the configuration.
pub const ADAPTER_FILES: [&str; 2] = ["adapter_model.safetensors", "adapter_config.json"];

/// PEFT's prefix before a model's own parameter names in an adapter file.
const PEFT_PREFIX: &str = "base_model.model.";

/// The adapters' configuration: rank, scale numerator, dropout on the adapter's input, and the
/// layers they go beside.
#[derive(Clone, Debug, PartialEq)]
pub struct Lora {
    pub rank: usize,
    /// The update is scaled by `alpha / rank`.
    pub alpha: f64,
    /// Dropout on the adapter's input (PEFT's `lora_dropout`), keyed like every dropout.
    pub dropout: f32,
    /// Layer names, matched as PEFT matches `target_modules`: the layer's name, or its last
    /// dot-separated components (`c_attn` targets `h.0.attn.c_attn`; `attn.c_proj` only the
    /// attention's projection).
    pub targets: Vec<String>,
    /// PEFT's flag of the same name: `true` starts B at zero (the adapted model computes what
    /// the base does); `false` draws B as A is drawn, so that every adapter gets a gradient from
    /// the first step (for benchmarks and gradient checks; PEFT's `init_lora_weights=False`).
    pub init_lora_weights: bool,
}

impl Default for Lora {
    /// PEFT's `LoraConfig` defaults: rank 8, alpha 8, no dropout, B started at zero; no targets.
    fn default() -> Self {
        Lora { rank: 8, alpha: 8.0, dropout: 0.0, targets: Vec::new(), init_lora_weights: true }
    }
}

impl Lora {
    /// Adapters of rank `rank` beside the layers `targets` names (`gpt2::LORA_TARGETS`, say),
    /// the rest PEFT's defaults ([`Lora::default`]).
    pub fn new(rank: usize, targets: &[&str]) -> Self {
        Lora { rank, targets: targets.iter().map(|t| t.to_string()).collect(), ..Lora::default() }
    }

    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// Whether the layer named `layer` gets an adapter.
    pub fn targets(&self, layer: &str) -> bool {
        self.targets.iter().any(|t| names(t, layer))
    }

    /// The configuration as a value equal exactly where two are (floats as their bits): what an
    /// adapted layer's costs depend on, for the planner's alike stages (`remat::Signature`).
    pub fn key(&self) -> (usize, u64, u32, Vec<String>, bool) {
        let (alpha, dropout) = (self.alpha.to_bits(), self.dropout.to_bits());
        (self.rank, alpha, dropout, self.targets.clone(), self.init_lora_weights)
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.rank == 0 {
            return Err("the LoRA rank must be at least 1".into());
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(format!("the LoRA alpha must be a positive number, got {}", self.alpha));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!("the LoRA dropout must be in [0, 1), got {}", self.dropout));
        }
        if self.targets.iter().all(|t| t.trim().is_empty()) {
            return Err("LoRA needs at least one target layer".into());
        }
        Ok(())
    }

    /// What does not train under LoRA: every parameter but the adapters'.
    pub fn freeze() -> Freeze {
        Freeze::all_but(&[format!("*.{LORA_A}"), format!("*.{LORA_B}")])
    }

    /// The shapes of the adapters beside `layers` (each its name, input and output widths): A
    /// (rank, in) and B (out, rank) for each layer it targets.
    pub fn adapter_shapes(
        &self,
        layers: impl IntoIterator<Item = (String, usize, usize)>,
    ) -> Vec<Vec<usize>> {
        let adapted = layers.into_iter().filter(|(name, _, _)| self.targets(name));
        adapted
            .flat_map(|(_, n_in, n_out)| [vec![self.rank, n_in], vec![n_out, self.rank]])
            .collect()
    }

    /// Of `targets`, those no layer named in `layers` matches (a typo adapts nothing).
    pub fn unmatched_targets<'a>(&'a self, layers: &[&str]) -> Vec<&'a str> {
        self.targets
            .iter()
            .filter(|t| !layers.iter().any(|l| names(t, l)))
            .map(String::as_str)
            .collect()
    }
}

/// Whether `target` names `layer` as PEFT's `target_modules` do: the whole name, or its last
/// dot-separated components.
fn names(target: &str, layer: &str) -> bool {
    layer == target || layer.strip_suffix(target).is_some_and(|head| head.ends_with('.'))
}

/// One layer's adapter: `scale * B(A(dropout(x)))` (the ops crate's `lora_linear` computes it
/// beside the layer).
pub struct Adapter {
    /// (r, in)
    pub a: Tensor,
    /// (out, r)
    pub b: Tensor,
    pub scale: f64,
    /// The dropout probability on the adapter's input.
    pub dropout: f32,
}

impl Adapter {
    /// The adapter of `layer` (`n_in` -> `n_out`) where `lora` targets it, registered with
    /// `params` for merging; `layout`: how the layer stores its weight (torch's `Linear`
    /// (out, in), GPT-2's `Conv1D` (in, out)).
    pub fn of(
        params: &mut ParamStore,
        lora: Option<&Lora>,
        layer: &str,
        (n_in, n_out): (usize, usize),
        layout: WeightLayout,
    ) -> Result<Option<Adapter>> {
        let Some(lora) = lora.filter(|l| l.targets(layer)) else { return Ok(None) };
        // PEFT: kaiming_uniform_(a = sqrt(5)) on (r, in): bound = sqrt(6 / (1 + 5)) / sqrt(in).
        let a = params.get(
            &format!("{layer}.{LORA_A}"),
            &[lora.rank, n_in],
            Init::Uniform { bound: 1.0 / (n_in as f32).sqrt() },
        )?;
        let b_init = if lora.init_lora_weights {
            Init::Zeros
        } else {
            Init::Uniform { bound: 1.0 / (lora.rank as f32).sqrt() }
        };
        let b = params.get(&format!("{layer}.{LORA_B}"), &[n_out, lora.rank], b_init)?;
        params.register_adapter(layer, layout, lora.scale());
        Ok(Some(Adapter { a, b, scale: lora.scale(), dropout: lora.dropout }))
    }
}

/// The metadata key under which a snapshot of a model with LoRA adapters keeps their scale
/// (alpha / rank), which its tensors do not show.
const LORA_SCALE: &str = "lora_scale";

impl ParamStore {
    /// What a snapshot of this store keeps besides its tensors: its adapters' scale, where it
    /// has adapters.
    pub fn metadata(&self) -> HashMap<String, String> {
        let scale = self.adapters.first().map(|a| (LORA_SCALE.to_string(), a.scale.to_string()));
        scale.into_iter().collect()
    }

    /// Refuses a snapshot at `path` whose adapters (its `tensors`, under this store's names, and
    /// its `metadata`) this store has at another rank or scale: loading them would drop them
    /// (another shape is initialised instead) or rescale them. Snapshots written before the scale
    /// was kept are checked for their rank.
    pub fn check_adapters(
        &self,
        tensors: &HashMap<String, Tensor>,
        metadata: &HashMap<String, String>,
        path: &str,
    ) -> std::result::Result<(), SnapshotError> {
        let Some(ours) = self.adapters.first() else { return Ok(()) };
        // lora_A is (rank, in).
        let rank_of = |t: &Tensor| t.dims().first().copied().unwrap_or(0);
        let a_name = format!("{}.{LORA_A}", ours.layer);
        let Some(our_rank) = self.all().find(|(n, _)| **n == a_name).map(|(_, v)| rank_of(v))
        else {
            return Ok(());
        };
        let Some((_, theirs)) = tensors.iter().find(|(n, _)| n.ends_with(LORA_A)) else {
            return Ok(());
        };
        let rank = rank_of(theirs);
        let scale = metadata.get(LORA_SCALE).and_then(|s| s.parse::<f64>().ok());
        if rank == our_rank && scale.is_none_or(|s| s == ours.scale) {
            return Ok(());
        }
        let describe = |rank: usize, scale: Option<f64>| match scale {
            Some(scale) => format!("rank {rank}, alpha {}", scale * rank as f64),
            None => format!("rank {rank}"),
        };
        Err(SnapshotError::AdapterConfig {
            path: path.to_string(),
            snapshot: describe(rank, scale),
            model: describe(our_rank, Some(ours.scale)),
        })
    }

    /// Records that `layer` has a LoRA adapter (its `lora_A`/`lora_B` parameters), for merging.
    pub(crate) fn register_adapter(&mut self, layer: &str, layout: WeightLayout, scale: f64) {
        self.adapters.push(AdapterInfo { layer: layer.into(), layout, scale });
    }

    /// Every parameter and buffer as a snapshot holds them, with each LoRA adapter folded into
    /// its layer's weight (`W + scale * B A`) and left out: the base model that computes what the
    /// adapted one does, for [`write_snapshot`] or a model without adapters.
    pub fn merged(&self) -> Result<HashMap<String, Tensor>> {
        let mut tensors = self.tensors();
        for a in &self.adapters {
            let take = |t: &mut HashMap<String, Tensor>, part: &str| {
                t.remove(&format!("{}.{part}", a.layer)).ok_or_else(|| {
                    candle_core::Error::Msg(format!("the adapter of `{}` has no {part}", a.layer))
                })
            };
            let (lora_a, lora_b) = (take(&mut tensors, LORA_A)?, take(&mut tensors, LORA_B)?);
            let weight = format!("{}.weight", a.layer);
            let base = tensors.get(&weight).ok_or_else(|| {
                candle_core::Error::Msg(format!("the adapted layer `{}` has no weight", a.layer))
            })?;
            let delta = lora_b
                .to_dtype(DType::F32)?
                .matmul(&lora_a.to_dtype(DType::F32)?)?
                .affine(a.scale, 0.0)?; // (out, in)
            let delta = match a.layout {
                WeightLayout::OutIn => delta,
                WeightLayout::InOut => delta.t()?,
            };
            let merged = (base.to_dtype(DType::F32)? + delta)?.to_dtype(base.dtype())?;
            tensors.insert(weight, merged);
        }
        Ok(tensors)
    }
}

/// What PEFT's `adapter_config.json` says about the model the adapter belongs to.
pub struct PeftModel<'a> {
    /// `base_model_name_or_path`: the Hugging Face model id (`gpt2`, `bert-large-uncased`).
    pub base_model: &'a str,
    /// `task_type`: `CAUSAL_LM` (GPT-2); none for a masked LM, which PEFT has no task for.
    pub task_type: Option<&'a str>,
    /// Whether the adapted layers store their weight (in, out) (GPT-2's `Conv1D`).
    pub fan_in_fan_out: bool,
    /// A parameter's name in the published model (what PEFT prefixes with `base_model.model.`).
    pub published_name: &'a dyn Fn(&str) -> String,
}

/// Writes the adapters of `params` into the folder `dir` as PEFT does: `adapter_model.safetensors`
/// and `adapter_config.json`.
pub fn save_adapter(
    dir: &Path,
    params: &ParamStore,
    lora: &Lora,
    model: &PeftModel,
) -> std::result::Result<(), SnapshotError> {
    let io = |source| SnapshotError::Io { path: dir.display().to_string(), source };
    std::fs::create_dir_all(dir).map_err(|e| io(e.into()))?;
    let tensors: HashMap<String, Tensor> = params
        .named()
        .filter(|(n, _)| is_adapter(n))
        .map(|(n, v)| {
            (format!("{PEFT_PREFIX}{}", (model.published_name)(n)), v.as_tensor().clone())
        })
        .collect();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_snapshot(&dir.join(ADAPTER_FILES[0]), &tensors, metadata).map_err(io)?;
    let mut targets = lora.targets.clone();
    targets.sort();
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": model.task_type,
        "base_model_name_or_path": model.base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": targets,
        "fan_in_fan_out": model.fan_in_fan_out,
        "bias": "none",
        "use_rslora": false,
        "init_lora_weights": lora.init_lora_weights,
        "inference_mode": true,
        "modules_to_save": null,
    });
    let text =
        serde_json::to_string_pretty(&config).map_err(|e| io(candle_core::Error::wrap(e)))?;
    write_atomically(&dir.join(ADAPTER_FILES[1]), |tmp| Ok(std::fs::write(tmp, text)?)).map_err(io)
}

/// What an adapter folder's `adapter_config.json` says the adapter computes: its [`Lora`] and how
/// the layers it was made for store their weights.
#[derive(Clone, Debug, PartialEq)]
pub struct AdapterConfig {
    pub lora: Lora,
    /// PEFT's `fan_in_fan_out`: whether the adapted layers store their weight (in, out).
    pub fan_in_fan_out: bool,
}

/// The keys of a LoRA `adapter_config.json` that do not change what a loaded adapter computes
/// (where it came from, how it was initialised); every key not here and not read must be unset
/// (`null`, `false`, `{}` or `[]`), for each one that is set asks for more than plain LoRA
/// (DoRA, rank-stabilised scaling, per-layer ranks, trained biases, extra modules ...).
const INFORMATIONAL: [&str; 10] = [
    "task_type",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "peft_version",
    "auto_mapping",
    "megatron_core",
    "qalora_group_size",
    "ensure_weight_tying",
    "init_lora_weights",
];

/// Reads `adapter_config.json` in the adapter folder `dir` as PEFT's `LoraConfig` does (a key
/// left out takes PEFT's default: `r` 8, `lora_alpha` 8, `lora_dropout` 0), refusing a
/// configuration that asks for what is not implemented here, naming the key and its value.
pub fn read_adapter_config(dir: &Path) -> std::result::Result<AdapterConfig, SnapshotError> {
    let path = dir.join(ADAPTER_FILES[1]);
    let p = path.display().to_string();
    let problem = |problem: String| SnapshotError::Config { path: p.clone(), problem };
    let text = std::fs::read_to_string(&path).map_err(|e| problem(e.to_string()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| problem(format!("not JSON: {e}")))?;
    let serde_json::Value::Object(keys) = json else {
        return Err(problem("not a JSON object".into()));
    };
    if !keys.contains_key("peft_type") {
        return Err(problem("no `peft_type`: not a PEFT adapter's configuration".into()));
    }
    let defaults = Lora::default();
    let number = |key: &str, default: f64| match keys.get(key) {
        None => Ok(default),
        Some(v) => v.as_f64().ok_or_else(|| problem(format!("`{key}` is {v}, not a number"))),
    };
    let rank = match keys.get("r") {
        None => defaults.rank,
        Some(v) => v
            .as_u64()
            .and_then(|r| usize::try_from(r).ok())
            .ok_or_else(|| problem(format!("`r` is {v}, not a rank")))?,
    };
    let lora = Lora {
        rank,
        alpha: number("lora_alpha", defaults.alpha)?,
        dropout: number("lora_dropout", defaults.dropout.into())? as f32,
        targets: target_modules(keys.get("target_modules")).map_err(problem)?,
        init_lora_weights: true,
    };
    lora.validate().map_err(problem)?;
    let fan_in_fan_out = match keys.get("fan_in_fan_out") {
        None => false,
        Some(v) => v.as_bool().ok_or_else(|| problem(format!("`fan_in_fan_out` is {v}")))?,
    };
    for (key, value) in &keys {
        if let Some(unsupported) = unsupported(key, value) {
            return Err(problem(unsupported));
        }
    }
    Ok(AdapterConfig { lora, fan_in_fan_out })
}

/// PEFT's `target_modules`: a list of layer names (a string is a regular expression in PEFT,
/// which is not implemented here).
fn target_modules(value: Option<&serde_json::Value>) -> std::result::Result<Vec<String>, String> {
    let names = value.and_then(|v| v.as_array()).and_then(|list| {
        list.iter().map(|t| t.as_str().map(str::to_string)).collect::<Option<Vec<_>>>()
    });
    match (value, names) {
        (_, Some(names)) => Ok(names),
        (Some(v @ serde_json::Value::String(_)), None) => Err(format!(
            "`target_modules` is the regular expression {v}: only a list of layer names is \
             supported"
        )),
        (None | Some(serde_json::Value::Null), None) => Err("`target_modules` is not given: \
             PEFT would take its defaults for the model type; list the layers"
            .into()),
        (Some(v), None) => Err(format!("`target_modules` is {v}, not a list of layer names")),
    }
}

/// Why the key `key` set to `value` asks for what is not implemented here, if it does.
fn unsupported(key: &str, value: &serde_json::Value) -> Option<String> {
    use serde_json::Value;
    let read = ["r", "lora_alpha", "lora_dropout", "target_modules", "fan_in_fan_out"];
    let fine = match (key, value) {
        ("peft_type", v) => v == "LORA",
        ("bias", v) => v == "none",
        // Initialisations that change the base weights (PiSSA, OLoRA, LoftQ ...) leave an
        // adapter that is wrong beside the published base.
        ("init_lora_weights", v) => v.is_boolean() || v == "gaussian",
        (k, _) if read.contains(&k) || INFORMATIONAL.contains(&k) => true,
        (_, Value::Null | Value::Bool(false)) => true,
        (_, Value::Object(o)) => o.is_empty(),
        (_, Value::Array(a)) => a.is_empty(),
        _ => false,
    };
    (!fine).then(|| {
        format!("`{key}` is {value}: not supported (this implements plain LoRA, scaled alpha / r)")
    })
}

/// Loads the adapter folder `dir` (PEFT's layout: [`save_adapter`]'s or PEFT's own) into the
/// adapters of `params`; `ours` maps a published parameter name to ours. Every adapter must be
/// found at its shape, and the file may hold no other adapter (another rank or targets).
pub fn load_adapter(
    dir: &Path,
    params: &ParamStore,
    ours: impl Fn(&str) -> Option<String>,
) -> std::result::Result<(), SnapshotError> {
    let path = dir.join(ADAPTER_FILES[0]);
    let (tensors, _) = read_snapshot(&path, params.device())?;
    let p = path.display().to_string();
    let mut found = HashMap::new();
    for (name, t) in tensors {
        let published = name.strip_prefix(PEFT_PREFIX).unwrap_or(&name);
        // PEFT's in-memory names carry the adapter's name (`lora_A.default.weight`); files do not.
        let published = published.replace(".default.weight", ".weight");
        match ours(&published).filter(|n| params.named().any(|(p, _)| p == n)) {
            Some(n) => found.insert(n, t),
            None => return Err(SnapshotError::Unexpected { path: p, name }),
        };
    }
    params.load_tensors(found, &p, |n| Some(n.to_string()), |n| !is_adapter(n)).map(drop)
}

/// Whether `name` is an adapter's parameter.
pub fn is_adapter(name: &str) -> bool {
    name.ends_with(LORA_A) || name.ends_with(LORA_B)
}

/// The layer whose adapter the parameter `name` belongs to (`h.0.attn.c_attn` of
/// `h.0.attn.c_attn.lora_A.weight`), if it is an adapter's.
pub fn adapted_layer(name: &str) -> Option<&str> {
    [LORA_A, LORA_B].iter().find_map(|part| name.strip_suffix(part)?.strip_suffix('.'))
}

#[cfg(test)]
mod tests {
    use super::read_adapter_config;

    /// `adapter_config.json` with `json` in a folder of its own; what reading it gives.
    fn read(name: &str, json: &str) -> Result<super::AdapterConfig, String> {
        let dir =
            std::env::temp_dir().join(format!("adapter-config-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("adapter_config.json"), json).unwrap();
        let read = read_adapter_config(&dir).map_err(|e| e.to_string());
        std::fs::remove_dir_all(&dir).unwrap();
        read
    }

    /// Keys left out take PEFT's defaults (r 8, alpha 8, dropout 0), as `LoraConfig(**json)`
    /// does; what PEFT would take from elsewhere (its default targets per model type) or does
    /// not mean plain LoRA is refused, naming the key.
    #[test]
    fn adapter_configs_read_as_peft_reads_them() {
        let config = read("defaults", r#"{"peft_type": "LORA", "target_modules": ["c_attn"]}"#);
        let lora = config.unwrap().lora;
        assert_eq!((lora.rank, lora.alpha, lora.dropout), (8, 8.0, 0.0));
        for (json, said) in [
            (r#"{"target_modules": ["c_attn"]}"#, "no `peft_type`"),
            (r#"{"peft_type": "LORA"}"#, "`target_modules` is not given"),
            (r#"{"peft_type": "LORA", "target_modules": ".*attn"}"#, "regular expression"),
            (r#"{"peft_type": "LORA", "target_modules": ["c_attn"], "r": -4}"#, "`r` is -4"),
            (
                r#"{"peft_type": "LORA", "target_modules": ["c_attn"],
                    "init_lora_weights": "pissa"}"#,
                r#"`init_lora_weights` is "pissa""#,
            ),
            (
                r#"{"peft_type": "LORA", "target_modules": ["c_attn"],
                    "rank_pattern": {"c_attn": 2}}"#,
                "`rank_pattern`",
            ),
            (r#"["LORA"]"#, "not a JSON object"),
        ] {
            let err = read("refused", json).unwrap_err();
            assert!(err.contains(said), "{json}: {err}");
        }
    }
}
