//! The model loads Hugging Face configs and weights and reproduces the saved model's logits.

use candle_core::{Device, Tensor};
use gpt2::{Config, Gpt2, Preset};
use std::collections::HashMap;
use std::path::PathBuf;
use trainable::Model;
use trainable::ModelConfig;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gpt2-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn presets_have_the_published_sizes() {
    // Parameter counts of Hugging Face's gpt2, gpt2-medium, gpt2-large, gpt2-xl (tied head).
    let count = |p: Preset| {
        let c = p.config();
        let (v, t, d, l) = (c.vocab_size, c.n_positions, c.n_embd, c.n_layer);
        v * d + t * d + l * (12 * d * d + 13 * d) + 2 * d
    };
    assert_eq!(count(Preset::Small), 124_439_808);
    assert_eq!(count(Preset::Medium), 354_823_168);
    assert_eq!(count(Preset::Large), 774_030_080);
    assert_eq!(count(Preset::Xl), 1_557_611_200);
    // ...and the model builds exactly those parameters.
    let tiny = Gpt2::new(Preset::Tiny.config(), &Device::Cpu, 0).unwrap();
    let c = Preset::Tiny.config();
    let (v, t, d, l) = (c.vocab_size, c.n_positions, c.n_embd, c.n_layer);
    assert_eq!(tiny.params().count(), v * d + t * d + l * (12 * d * d + 13 * d) + 2 * d);
    assert!("huge".parse::<Preset>().unwrap_err().to_string().contains("small (124M)"));
}

#[test]
fn hugging_face_snapshot_reproduces_the_logits() {
    let dir = temp_dir("snapshot");
    let cfg = Config::tiny(2, 32);
    let saved = Gpt2::new(cfg.clone(), &Device::Cpu, 1).unwrap();
    // Write the file the way a GPT2LMHeadModel state dict looks: prefixed names, the tied head,
    // and the attention-mask buffers.
    let mut tensors: HashMap<String, Tensor> = saved
        .params()
        .named()
        .map(|(n, v)| (format!("transformer.{n}"), v.as_tensor().clone()))
        .collect();
    let wte = tensors["transformer.wte.weight"].clone();
    tensors.insert("lm_head.weight".into(), wte);
    tensors.insert(
        "transformer.h.0.attn.bias".into(),
        Tensor::ones((1, 1, 4, 4), candle_core::DType::F32, &Device::Cpu).unwrap(),
    );
    let path = dir.join("model.safetensors");
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let config_path = dir.join("config.json");
    let mut json = serde_json::to_value(&cfg).unwrap();
    json["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
    json["activation_function"] = serde_json::json!("gelu_new");
    std::fs::write(&config_path, json.to_string()).unwrap();

    let loaded = Gpt2::new(Config::from_json(&config_path).unwrap(), &Device::Cpu, 2).unwrap();
    let ids = Tensor::new(&[[1u32, 5, 9, 200], [3, 3, 7, 0]], &Device::Cpu).unwrap();
    let before = loaded
        .logits(&ids, remat::RunMode::Eval)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let want = saved
        .logits(&ids, remat::RunMode::Eval)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_ne!(before, want, "different seeds must give different models");
    loaded.load_snapshot(&path).unwrap();
    assert_eq!(
        loaded
            .logits(&ids, remat::RunMode::Eval)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap(),
        want
    );

    // Our own snapshots round-trip too, and a wrong-sized file names the tensor.
    let own = dir.join("own.safetensors");
    saved.save_snapshot(&own).unwrap();
    loaded.load_snapshot(&own).unwrap();
    let wider = Gpt2::new(Config::tiny(2, 64), &Device::Cpu, 1).unwrap();
    let err = wider.load_snapshot(&own).unwrap_err().to_string();
    assert!(err.contains("has shape [96]") && err.contains("expects [192]"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_configs_name_the_field() {
    let dir = temp_dir("config");
    let path = dir.join("config.json");
    std::fs::write(
        &path,
        r#"{"vocab_size": 10, "n_positions": 8, "n_embd": 30, "n_layer": 1, "n_head": 4}"#,
    )
    .unwrap();
    assert!(Config::from_json(&path).unwrap_err().to_string().contains("n_head"));
    std::fs::write(&path, r#"{"vocab_size": 10, "n_positions": 8, "n_layer": 1, "n_head": 4}"#)
        .unwrap();
    assert!(Config::from_json(&path).unwrap_err().to_string().contains("n_embd"));
    // A zero width passed the heads' check and panicked in the embedding (`chunk_size must not
    // be zero`).
    std::fs::write(
        &path,
        r#"{"vocab_size": 10, "n_positions": 8, "n_embd": 0, "n_layer": 1, "n_head": 4}"#,
    )
    .unwrap();
    let err = Config::from_json(&path).unwrap_err().to_string();
    assert!(err.contains("n_embd must be in 1..=2147483648, got 0"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every size is bounded before anything is built: a width near 2^63 overflowed the products
/// of sizes before the footprint check could name it.
#[test]
fn sizes_beyond_their_bound_name_the_field() {
    let dir = temp_dir("config-bounds");
    let path = dir.join("config.json");
    for (field, value) in [("n_embd", "9223372036854775808"), ("n_layer", "4294967296")] {
        let sizes =
            [("vocab_size", "10"), ("n_positions", "8"), ("n_layer", "1"), ("n_embd", "32")];
        let mut fields: Vec<String> = sizes
            .iter()
            .map(|(f, v)| format!(r#""{f}": {}"#, if *f == field { value } else { v }))
            .collect();
        fields.push(r#""n_head": 4"#.into());
        let json = format!("{{{}}}", fields.join(", "));
        std::fs::write(&path, json).unwrap();
        let err = Config::from_json(&path).unwrap_err().to_string();
        assert!(err.contains(&format!("{field} must be in 1..=2147483648, got {value}")), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A config.json key of a GPT-2 variant this crate does not implement is refused naming it and
/// what is implemented: `activation_function: "relu"`, `n_inner`, `scale_attn_by_inverse_layer_idx`
/// and `tie_word_embeddings: false` gave the same model as without them. GPT-2's own values load.
#[test]
fn keys_of_variants_not_implemented_are_refused() {
    let dir = temp_dir("config-variants");
    let path = dir.join("config.json");
    let base = r#""vocab_size": 10, "n_positions": 8, "n_embd": 32, "n_layer": 1, "n_head": 4"#;
    for (key, said) in [
        (
            r#""activation_function": "relu""#,
            r#"activation_function "relu" is not implemented by this model (supported: "gelu_new", "gelu_pytorch_tanh")"#,
        ),
        (r#""n_inner": 64"#, "n_inner 64 is not implemented by this model (supported: null, 128)"),
        (r#""scale_attn_by_inverse_layer_idx": true"#, "scale_attn_by_inverse_layer_idx true"),
        (r#""tie_word_embeddings": false"#, "tie_word_embeddings false"),
    ] {
        std::fs::write(&path, format!("{{{base}, {key}}}")).unwrap();
        let err = Config::from_json(&path).unwrap_err().to_string();
        assert!(err.contains(said), "{key}: {err}");
    }
    let published =
        r#""activation_function": "gelu_new", "n_inner": null, "tie_word_embeddings": true"#;
    std::fs::write(&path, format!("{{{base}, {published}}}")).unwrap();
    Config::from_json(&path).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// GPT-2's parameter and LoRA adapter shapes derived from its configuration (how the harness
/// predicts the state of sizes it cannot build) are those of the model built; and GPT-2 XL has its published
/// 1,557,611,200 parameters.
#[test]
fn parameter_shapes_from_the_configuration_match_the_model() {
    use trainable::Benchable;
    let tiny = gpt2::Config::tiny(3, 32);
    for lora in [None, Some(&gpt2::LORA_TARGETS[..]), Some(&["attn.c_proj"][..])] {
        let lora = lora.map(|targets| params::lora::Lora::new(4, targets));
        let config = gpt2::Config { lora, ..tiny.clone() };
        testkit::checkpointing::assert_parameter_shapes_match_the_model::<Gpt2>(&config);
    }
    let xl: usize = Gpt2::parameter_shapes(&Preset::Xl.config())
        .unwrap()
        .iter()
        .map(|s| s.iter().product::<usize>())
        .sum();
    assert_eq!(xl, 1_557_611_200);
}

/// A training-mode forward outside the executor draws the dropout masks the step draws: the
/// cross-entropy of its logits is the step's loss (dropout on everywhere); evaluation and another
/// step draw other masks.
#[test]
fn training_mode_logits_give_the_steps_loss() {
    let model = Gpt2::new(Config::tiny(2, 32), &Device::Cpu, 1).unwrap();
    let ids: Vec<u32> = (0..32).map(|i| (i * 37 % 256) as u32).collect();
    let targets: Vec<u32> = (0..32).map(|i| (i * 11 % 256) as u32).collect();
    let inputs = model.inputs(&ids, &targets, 2, 16, &Device::Cpu).unwrap();
    let (seed, step) = (5, 3);
    let loss = model.graph().plain_loss(&inputs, seed, step).unwrap().to_scalar::<f32>().unwrap();
    let ce = |mode| {
        let logits = model.logits(&inputs[0], mode).unwrap().flatten_to(1).unwrap(); // (B*T, V)
        candle_nn::loss::cross_entropy(&logits, &inputs[1].flatten_all().unwrap())
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    let train = ce(remat::RunMode::Train { seed, step });
    // The step's loss comes from the fused cross-entropy, this one from candle-nn's: the same
    // logits, summed in another order.
    assert!(
        (train - loss).abs() < 1e-5 * loss,
        "training-mode logits give {train}, the step's loss is {loss}"
    );
    // At initialisation the logits are near uniform, so the losses are close: the logits tell.
    let logits = |mode| {
        model.logits(&inputs[0], mode).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    assert_ne!(
        logits(remat::RunMode::Train { seed, step }),
        logits(remat::RunMode::Eval),
        "training mode drew no dropout"
    );
    assert_ne!(
        logits(remat::RunMode::Train { seed, step }),
        logits(remat::RunMode::Train { seed, step: step + 1 }),
        "another step, other masks"
    );
}
