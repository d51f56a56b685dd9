//! Our Llama family against an implementation no one here wrote: candle-transformers' own
//! `llama`, `qwen2` and `qwen3` (inference only), given the same `config.json` and the same
//! weights, must give the same logits (f32, within 1e-5 of their scale). The `config.json` is
//! read by both: by ours through `Config::from_json_text`, as `train-llama --config` reads it.

use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::VarBuilder;
use llama::{Config, Llama};
use serde_json::json;
use trainable::Model;

/// A tiny `config.json` of `architecture` in Hugging Face's keys, with what each reference needs.
fn config_json(architecture: &str, extra: serde_json::Value) -> String {
    let mut config = json!({
        "architectures": [architecture],
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": false, "hidden_act": "silu",
        "sliding_window": 4096, "max_window_layers": 3, "use_sliding_window": false,
        "attention_bias": false,
    });
    config.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    config.to_string()
}

/// Our model of `json` with seeded random weights, and those weights under their names.
fn ours(json: &str) -> (Llama, std::collections::HashMap<String, Tensor>) {
    let config = Config::from_json_text(json).unwrap();
    config.validate().unwrap();
    let model = Llama::new(config, &Device::Cpu, 3).unwrap();
    // Random q/k norms and biases too: their initial ones and zeros would hide a misplaced one.
    for (name, var) in model.params().named() {
        if name.ends_with("norm.weight") || name.ends_with(".bias") {
            var.set(&Tensor::randn(0f32, 0.5, var.dims(), &Device::Cpu).unwrap()).unwrap();
        }
    }
    let tensors = model.params().tensors();
    (model, tensors)
}

/// Ids (2, 12) and our last position's logits (2, V).
fn our_last_logits(model: &Llama) -> (Tensor, Tensor) {
    let ids: Vec<u32> = (0..24).map(|i| (i * 37 + 11) % 256).collect();
    let ids = Tensor::from_vec(ids, (2, 12), &Device::Cpu).unwrap();
    let logits = model.logits(&ids, remat::RunMode::Eval).unwrap();
    (ids.clone(), logits.i((.., 11, ..)).unwrap().contiguous().unwrap())
}

fn assert_close(ours: &Tensor, theirs: &Tensor, what: &str) {
    let (a, b) = (
        ours.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        theirs.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
    );
    assert_eq!(a.len(), b.len(), "{what}");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(worst <= 1e-5 * scale, "{what}: logits differ by {worst} (scale {scale})");
}

#[test]
fn llama_with_llama3_rope_scaling_matches_candle_transformers() {
    let scaling = json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}});
    for tied in [false, true] {
        let mut extra = scaling.clone();
        extra["tie_word_embeddings"] = json!(tied);
        let json = config_json("LlamaForCausalLM", extra);
        let (model, tensors) = ours(&json);
        let (ids, logits) = our_last_logits(&model);
        let cfg: candle_transformers::models::llama::LlamaConfig =
            serde_json::from_str(&json).unwrap();
        let cfg = cfg.into_config(false);
        let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
        let reference = candle_transformers::models::llama::Llama::load(vb, &cfg).unwrap();
        let mut cache =
            candle_transformers::models::llama::Cache::new(false, DType::F32, &cfg, &Device::Cpu)
                .unwrap();
        let theirs = reference.forward(&ids, 0, &mut cache).unwrap();
        assert_close(&logits, &theirs, &format!("llama, tied {tied}"));
    }
}

#[test]
fn qwen2_with_its_qkv_bias_matches_candle_transformers() {
    let json = config_json("Qwen2ForCausalLM", json!({"rope_theta": 1000000.0}));
    let (model, tensors) = ours(&json);
    assert!(tensors.contains_key("model.layers.0.self_attn.q_proj.bias"));
    let (ids, logits) = our_last_logits(&model);
    let cfg: candle_transformers::models::qwen2::Config = serde_json::from_str(&json).unwrap();
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    let mut reference =
        candle_transformers::models::qwen2::ModelForCausalLM::new(&cfg, vb).unwrap();
    let theirs = reference.forward(&ids, 0).unwrap().squeeze(1).unwrap();
    assert_close(&logits, &theirs, "qwen2");
}

#[test]
fn qwen3_with_its_qk_norms_matches_candle_transformers() {
    let json =
        config_json("Qwen3ForCausalLM", json!({"head_dim": 32, "tie_word_embeddings": true}));
    let (model, tensors) = ours(&json);
    assert!(tensors.contains_key("model.layers.0.self_attn.q_norm.weight"));
    let (ids, logits) = our_last_logits(&model);
    let cfg: candle_transformers::models::qwen3::Config = serde_json::from_str(&json).unwrap();
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    let mut reference =
        candle_transformers::models::qwen3::ModelForCausalLM::new(&cfg, vb).unwrap();
    let theirs = reference.forward(&ids, 0).unwrap().squeeze(1).unwrap();
    assert_close(&logits, &theirs, "qwen3");
}
