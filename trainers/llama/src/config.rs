//! A Llama-family model's configuration: read from a Hugging Face `config.json` as
//! `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM` and `Qwen3ForCausalLM` read it
//! (`architectures` decides what differs), with every feature this crate does not implement
//! refused naming its key; and the published shapes as presets.

use params::lora::Lora;
use serde::Serialize;
use serde_json::{Map, Value};
use std::path::Path;
use trainable::ConfigError;

/// Which of the four classes a configuration is for: what differs between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Architecture {
    /// `LlamaForCausalLM` (Llama 2/3.x, SmolLM2).
    Llama,
    /// `MistralForCausalLM`: Llama's layers; a sliding window where the config sets one.
    Mistral,
    /// `Qwen2ForCausalLM` (Qwen2.5): bias on q, k and v.
    Qwen2,
    /// `Qwen3ForCausalLM`: RMSNorm of each head of q and k.
    Qwen3,
}

impl Architecture {
    const NAMES: [(&'static str, Architecture); 4] = [
        ("LlamaForCausalLM", Architecture::Llama),
        ("MistralForCausalLM", Architecture::Mistral),
        ("Qwen2ForCausalLM", Architecture::Qwen2),
        ("Qwen3ForCausalLM", Architecture::Qwen3),
    ];
}

/// The rotary embedding: its base, and Llama 3's scaling of the low frequencies where given.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Rope {
    pub theta: f64,
    pub llama3: Option<Llama3Scaling>,
}

/// `rope_scaling` of type `llama3` (Llama 3.1/3.2): wavelengths longer than the original context
/// over `low_freq_factor` are divided by `factor`, those between smoothly interpolated.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

impl Rope {
    /// The inverse frequency of each of the `head_dim / 2` pairs, as `transformers` computes them
    /// (`_compute_default_rope_parameters`, `_compute_llama3_parameters`).
    pub fn inverse_frequencies(&self, head_dim: usize) -> Vec<f32> {
        let base: Vec<f64> = (0..head_dim / 2)
            .map(|i| 1.0 / self.theta.powf((2 * i) as f64 / head_dim as f64))
            .collect();
        let Some(s) = &self.llama3 else { return base.iter().map(|&f| f as f32).collect() };
        let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
        let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
        base.iter()
            .map(|&f| {
                let wavelen = 2.0 * std::f64::consts::PI / f;
                let scaled = if wavelen > low_wavelen { f / s.factor } else { f };
                let medium = (high_wavelen..=low_wavelen).contains(&wavelen);
                let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                let f = if medium {
                    (1.0 - smooth) * scaled / s.factor + smooth * scaled
                } else {
                    scaled
                };
                f as f32
            })
            .collect()
    }
}

/// Hyper-parameters under Hugging Face's names.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Config {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope: Rope,
    pub tie_word_embeddings: bool,
    pub attention_dropout: f32,
    /// Mistral's attention window: a sequence longer than it is refused (the window is not
    /// implemented; within it, attention is plain causal).
    pub sliding_window: Option<usize>,
    /// The dtype activations are stored in (not in `config.json`: a training choice).
    #[serde(skip)]
    pub dtype: trainable::Precision,
    /// The parameters that do not train (`--freeze`).
    #[serde(skip)]
    pub freeze: params::Freeze,
    /// LoRA adapters beside the layers it targets, every base parameter frozen (`--lora`).
    #[serde(skip)]
    pub lora: Option<Lora>,
}

/// The layers LoRA adapts unless told otherwise (`--lora-targets`): every projection of the
/// attention and the MLP, PEFT's usual choice for these models.
pub const LORA_TARGETS: [&str; 7] =
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

/// The published shapes, plus `tiny` for tests: for `--dry-run`, the planner and benchmarks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    Tiny,
    Smollm2_135m,
    Qwen2_5_0_5b,
    Qwen3_0_6b,
    Llama3_2_1b,
    Llama3_2_3b,
    Qwen2_5_7b,
    Llama3_1_8b,
}

trainable::presets!(Preset, "Llama-family", [
    Preset::Tiny => "tiny",
    Preset::Smollm2_135m => "smollm2-135m",
    Preset::Qwen2_5_0_5b => "qwen2.5-0.5b",
    Preset::Qwen3_0_6b => "qwen3-0.6b",
    Preset::Llama3_2_1b => "llama-3.2-1b",
    Preset::Llama3_2_3b => "llama-3.2-3b",
    Preset::Qwen2_5_7b => "qwen2.5-7b",
    Preset::Llama3_1_8b => "llama-3.1-8b",
]);

impl Preset {
    /// The shape its `config.json` publishes.
    pub fn config(self) -> Config {
        use Architecture::*;
        // (architecture, hidden, intermediate, layers, heads, kv heads, head_dim, vocab)
        let (architecture, c, i, l, h, kv, hd, v) = match self {
            Preset::Tiny => return Config::tiny(Llama),
            Preset::Smollm2_135m => (Llama, 576, 1536, 30, 9, 3, 64, 49152),
            Preset::Qwen2_5_0_5b => (Qwen2, 896, 4864, 24, 14, 2, 64, 151936),
            Preset::Qwen3_0_6b => (Qwen3, 1024, 3072, 28, 16, 8, 128, 151936),
            Preset::Llama3_2_1b => (Llama, 2048, 8192, 16, 32, 8, 64, 128256),
            Preset::Llama3_2_3b => (Llama, 3072, 8192, 28, 24, 8, 128, 128256),
            Preset::Qwen2_5_7b => (Qwen2, 3584, 18944, 28, 28, 4, 128, 152064),
            Preset::Llama3_1_8b => (Llama, 4096, 14336, 32, 32, 8, 128, 128256),
        };
        let llama3 = |factor| Llama3Scaling {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let (theta, scaling, positions, eps, tied) = match self {
            Preset::Smollm2_135m => (100_000.0, None, 8192, 1e-5, true),
            Preset::Qwen2_5_0_5b => (1e6, None, 32768, 1e-6, true),
            Preset::Qwen3_0_6b => (1e6, None, 40960, 1e-6, true),
            Preset::Llama3_2_1b | Preset::Llama3_2_3b => {
                (5e5, Some(llama3(32.0)), 131072, 1e-5, true)
            }
            Preset::Qwen2_5_7b => (1e6, None, 32768, 1e-6, false),
            Preset::Llama3_1_8b => (5e5, Some(llama3(8.0)), 131072, 1e-5, false),
            Preset::Tiny => unreachable!("returned above"),
        };
        Config {
            architecture,
            vocab_size: v,
            hidden_size: c,
            intermediate_size: i,
            num_hidden_layers: l,
            num_attention_heads: h,
            num_key_value_heads: kv,
            head_dim: hd,
            max_position_embeddings: positions,
            rms_norm_eps: eps,
            rope: Rope { theta, llama3: scaling },
            tie_word_embeddings: tied,
            attention_dropout: 0.0,
            sliding_window: None,
            ..Config::tiny(architecture)
        }
    }
}

impl Config {
    /// A byte-vocabulary model of `architecture`: 2 layers of width 64, 4 query heads sharing 2
    /// key/value heads, attention dropout 0.1 (so that tests see dropout replayed).
    pub fn tiny(architecture: Architecture) -> Self {
        Config {
            architecture,
            vocab_size: 256,
            hidden_size: 64,
            intermediate_size: 128,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            max_position_embeddings: 256,
            rms_norm_eps: 1e-6,
            rope: Rope { theta: 10_000.0, llama3: None },
            tie_word_embeddings: false,
            attention_dropout: 0.1,
            sliding_window: None,
            dtype: trainable::Precision::F32,
            freeze: params::Freeze::default(),
            lora: None,
        }
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        use trainable::check;
        check::positive(&[
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ])?;
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head_dim ({}) must be even: the rotary embedding pairs its halves",
                self.head_dim
            ));
        }
        check::heads(
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
        )?;
        check::epsilon(("rms_norm_eps", self.rms_norm_eps))?;
        if !(self.rope.theta.is_finite() && self.rope.theta > 1.0) {
            return Err(format!("rope_theta must be a number above 1, got {}", self.rope.theta));
        }
        check::probabilities(&[("attention_dropout", self.attention_dropout)])?;
        check::lora(self.lora.as_ref())
    }

    /// Reads a `config.json` as the class its `architectures` names reads it.
    pub fn from_json_text(text: &str) -> std::result::Result<Self, String> {
        let json: Map<String, Value> = serde_json::from_str(text).map_err(|e| e.to_string())?;
        Fields(&json).config()
    }
}

impl trainable::ModelConfig for Config {
    fn from_json(path: &Path) -> std::result::Result<Self, ConfigError> {
        let fail = |reason: String| ConfigError { path: path.display().to_string(), reason };
        let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
        let config = Config::from_json_text(&text).map_err(fail)?;
        config.validate().map_err(fail)?;
        Ok(config)
    }

    fn set_precision(&mut self, dtype: trainable::Precision) {
        self.dtype = dtype;
    }

    fn set_freeze(&mut self, freeze: params::Freeze) {
        self.freeze = freeze;
    }

    /// The narrowest side of the layers adapted: the key/value projections' width.
    fn lora_width(&self) -> Option<usize> {
        Some(self.hidden_size.min(self.num_key_value_heads * self.head_dim))
    }

    fn set_lora(&mut self, lora: Lora) -> std::result::Result<(), String> {
        self.lora = Some(lora);
        Ok(())
    }
}

/// The fields of a `config.json`, read with the error that names the key.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn size(&self, key: &str) -> std::result::Result<Option<usize>, String> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .map(|n| n as usize)
                    .ok_or(format!("{key} must be a whole number, got {v}"))
            })
            .transpose()
    }

    fn required(&self, key: &str) -> std::result::Result<usize, String> {
        self.size(key)?.ok_or(format!("{key} is missing"))
    }

    fn number(&self, key: &str, default: f64) -> std::result::Result<f64, String> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or(format!("{key} must be a number, got {v}")),
        }
    }

    fn flag(&self, key: &str, default: bool) -> std::result::Result<bool, String> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or(format!("{key} must be true or false, got {v}")),
        }
    }

    /// `key` is absent or one of `supported` (JSON values): another would be ignored.
    fn only(&self, key: &str, supported: &[Value]) -> std::result::Result<(), String> {
        self.get(key).map_or(Ok(()), |v| trainable::check::implemented(key, v, supported))
    }

    fn architecture(&self) -> std::result::Result<Architecture, String> {
        let names: Vec<&str> = Architecture::NAMES.iter().map(|(n, _)| *n).collect();
        let given = self.get("architectures").and_then(|v| v.as_array()?.first()?.as_str());
        let Some(given) = given else {
            return Err(format!("architectures is missing; one of {} is needed", names.join(", ")));
        };
        Architecture::NAMES.iter().find(|(name, _)| *name == given).map(|(_, a)| *a).ok_or(format!(
            "architectures {given} is not implemented (supported: {})",
            names.join(", ")
        ))
    }

    /// `rope_theta` and `rope_scaling`, or `transformers` 5's `rope_parameters`, which holds both.
    fn rope(&self) -> std::result::Result<Rope, String> {
        let (scaling_key, scaling) = match (self.get("rope_parameters"), self.get("rope_scaling")) {
            (Some(p), _) => ("rope_parameters", Some(p)),
            (None, s) => ("rope_scaling", s),
        };
        let inner = scaling.and_then(Value::as_object);
        let theta = match inner.and_then(|p| p.get("rope_theta")) {
            Some(v) => v.as_f64().ok_or(format!("{scaling_key}.rope_theta must be a number"))?,
            None => self.number("rope_theta", 10_000.0)?,
        };
        let Some(p) = inner else {
            if let Some(v) = scaling {
                return Err(format!("{scaling_key} must be an object, got {v}"));
            }
            return Ok(Rope { theta, llama3: None });
        };
        let kind =
            p.get("rope_type").or(p.get("type")).and_then(Value::as_str).unwrap_or("default");
        let factor = |key: &str| {
            p.get(key).and_then(Value::as_f64).ok_or(format!("{scaling_key}.{key} is missing"))
        };
        match kind {
            "default" => Ok(Rope { theta, llama3: None }),
            "llama3" => Ok(Rope {
                theta,
                llama3: Some(Llama3Scaling {
                    factor: factor("factor")?,
                    low_freq_factor: factor("low_freq_factor")?,
                    high_freq_factor: factor("high_freq_factor")?,
                    original_max_position_embeddings: factor("original_max_position_embeddings")?,
                }),
            }),
            other => Err(format!(
                "{scaling_key}.rope_type \"{other}\" is not implemented (supported: \"default\", \
                 \"llama3\")"
            )),
        }
    }

    fn config(&self) -> std::result::Result<Config, String> {
        let architecture = self.architecture()?;
        // Features of these classes this crate does not implement: refused, not ignored.
        self.only("hidden_act", &["silu".into()])?;
        self.only("mlp_bias", &[false.into()])?;
        self.only("attention_bias", &[false.into()])?;
        self.only("use_sliding_window", &[false.into()])?;
        for moe in ["num_experts", "num_local_experts", "num_experts_per_tok"] {
            self.only(moe, &[0.into()])?;
        }
        let hidden_size = self.required("hidden_size")?;
        let num_attention_heads = self.required("num_attention_heads")?;
        let head_dim = match self.size("head_dim")? {
            Some(d) => d,
            None if num_attention_heads > 0 => hidden_size / num_attention_heads,
            None => return Err("num_attention_heads must be at least 1".into()),
        };
        // Qwen2 configs carry a window they do not use unless use_sliding_window says so.
        let sliding_window = match architecture {
            Architecture::Mistral | Architecture::Llama => self.size("sliding_window")?,
            Architecture::Qwen2 | Architecture::Qwen3 => None,
        };
        Ok(Config {
            architecture,
            vocab_size: self.required("vocab_size")?,
            hidden_size,
            intermediate_size: self.required("intermediate_size")?,
            num_hidden_layers: self.required("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: self.size("num_key_value_heads")?.unwrap_or(num_attention_heads),
            head_dim,
            max_position_embeddings: self.size("max_position_embeddings")?.unwrap_or(2048),
            rms_norm_eps: self.number("rms_norm_eps", 1e-6)?,
            rope: self.rope()?,
            tie_word_embeddings: self.flag("tie_word_embeddings", false)?,
            attention_dropout: self.number("attention_dropout", 0.0)? as f32,
            sliding_window,
            ..Config::tiny(architecture)
        })
    }
}
