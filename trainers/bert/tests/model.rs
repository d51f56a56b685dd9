//! Hugging Face configs and weights load (from files and from a hub cache, offline) and reproduce
//! the saved model's logits, and so do our own snapshots; the trainer rejects bad input clearly.

use bert::{Bert, Config};
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use trainable::Model;
use trainable::ModelConfig;
use trainkit::hub::Download;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bert-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes config.json and model.safetensors the way the hub serves `BertForMaskedLM` (old
/// gamma/beta LayerNorm names, a pooler, the tied decoder copy) into `dir`.
fn write_hf_files(model: &Bert, dir: &Path) {
    let mut tensors: HashMap<String, Tensor> = model
        .params()
        .named()
        .map(|(n, v)| {
            (
                n.replace("LayerNorm.weight", "LayerNorm.gamma")
                    .replace("LayerNorm.bias", "LayerNorm.beta"),
                v.as_tensor().clone(),
            )
        })
        .collect();
    let word = tensors["bert.embeddings.word_embeddings.weight"].clone();
    tensors.insert("cls.predictions.decoder.weight".into(), word);
    let c = model.config.hidden_size;
    tensors.insert(
        "bert.pooler.dense.weight".into(),
        Tensor::zeros((c, c), candle_core::DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    let mut json = serde_json::to_value(&model.config).unwrap();
    json["architectures"] = serde_json::json!(["BertForMaskedLM"]);
    json["hidden_act"] = serde_json::json!("gelu");
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
}

fn logits(model: &Bert) -> Vec<f32> {
    let ids = Tensor::new(&[[2u32, 7, 9, 4, 3], [2, 30, 31, 32, 3]], &Device::Cpu).unwrap();
    model
        .logits(
            &model.hidden_states(&ids, None, None, remat::RunMode::Eval).unwrap(),
            remat::RunMode::Eval,
        )
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

#[test]
fn config_and_safetensors_reproduce_the_logits() {
    let dir = temp_dir("files");
    let saved = Bert::new(Config::tiny(2, 32), &Device::Cpu, 1).unwrap();
    write_hf_files(&saved, &dir);
    let loaded =
        Bert::new(Config::from_json(&dir.join("config.json")).unwrap(), &Device::Cpu, 2).unwrap();
    assert_ne!(logits(&loaded), logits(&saved));
    loaded.load_snapshot(&dir.join("model.safetensors")).unwrap();
    assert_eq!(logits(&loaded), logits(&saved));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn own_snapshot_round_trips_into_a_freshly_seeded_model() {
    // What `--save` writes loads back: our own names pass the Hugging Face renaming unchanged.
    let saved = Bert::new(Config::tiny(2, 32), &Device::Cpu, 1).unwrap();
    let fresh = Bert::new(Config::tiny(2, 32), &Device::Cpu, 2).unwrap();
    testkit::assert_snapshot_round_trip(&saved, &fresh, Bert::params, logits, Bert::load_snapshot);
}

#[test]
fn a_model_id_resolves_from_the_hub_cache_offline() {
    let cache = temp_dir("hub");
    let snapshot = trainkit::hub::cache_folder(&cache, "someone/tiny-bert").unwrap();
    let saved = Bert::new(Config::tiny(2, 32), &Device::Cpu, 1).unwrap();
    write_hf_files(&saved, &snapshot);

    let files =
        trainkit::hub::hub_files("someone/tiny-bert", Some(&cache), Download::Never).unwrap();
    let loaded = Bert::new(Config::from_json(&files.config).unwrap(), &Device::Cpu, 5).unwrap();
    loaded.load_snapshot(&files.weights).unwrap();
    assert_eq!(logits(&loaded), logits(&saved));
    let err = trainkit::hub::hub_files("someone/missing", Some(&cache), Download::Never)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not in the cache") && err.contains("offline"), "{err}");

    // The trainer takes the same path: one step from the cached weights.
    let out = Command::new(env!("CARGO_BIN_EXE_train-bert"))
        .args([
            "--model-id",
            "someone/tiny-bert",
            "--hub-cache",
            cache.to_str().unwrap(),
            "--offline",
            "--steps",
            "1",
            "--seq",
            "16",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::remove_dir_all(&cache).unwrap();
}

#[test]
fn bad_input_gives_clear_errors() {
    let run =
        |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_train-bert")).args(args).output().unwrap();
    for (args, needle) in [
        (vec!["--preset", "huge"], "valid presets: tiny, base"),
        (vec!["--preset", "tiny", "--seq", "300"], "max_position_embeddings (256)"),
        (vec!["--preset", "tiny", "--policy", "half"], "valid policies"),
    ] {
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && !err.contains("panicked") && err.contains(needle),
            "{args:?}: {err}"
        );
    }
    let dir = temp_dir("config");
    let path = dir.join("config.json");
    let config = r#"{"vocab_size": 10, "hidden_size": 30, "num_hidden_layers": 1,
        "num_attention_heads": 4, "intermediate_size": 8}"#;
    std::fs::write(&path, config).unwrap();
    assert!(Config::from_json(&path).unwrap_err().to_string().contains("num_attention_heads"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A config.json key of a BERT variant this crate does not implement is refused naming it and
/// what is implemented: `hidden_act: "relu"` and `position_embedding_type: "relative_key"` gave
/// the same model as without them. BERT's own values load; a size beyond its bound is named.
#[test]
fn keys_of_variants_not_implemented_are_refused() {
    let dir = temp_dir("config-variants");
    let path = dir.join("config.json");
    let base = r#""vocab_size": 10, "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 4, "intermediate_size": 8"#;
    for (key, said) in [
        (
            r#""hidden_act": "relu""#,
            r#"hidden_act "relu" is not implemented by this model (supported: "gelu")"#,
        ),
        (
            r#""position_embedding_type": "relative_key""#,
            r#"position_embedding_type "relative_key""#,
        ),
        (r#""type_vocab_size": 4294967296"#, "type_vocab_size must be in 1..=2147483648"),
    ] {
        std::fs::write(&path, format!("{{{base}, {key}}}")).unwrap();
        let err = Config::from_json(&path).unwrap_err().to_string();
        assert!(err.contains(said), "{key}: {err}");
    }
    let published = r#""hidden_act": "gelu", "position_embedding_type": "absolute""#;
    std::fs::write(&path, format!("{{{base}, {published}}}")).unwrap();
    Config::from_json(&path).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn loss_falls_on_the_default_corpus() {
    let log = temp_dir("log").join("log.jsonl");
    let out = Command::new(env!("CARGO_BIN_EXE_train-bert"))
        .args([
            "--preset",
            "tiny",
            "--steps",
            "40",
            "--batch",
            "8",
            "--seq",
            "32",
            "--lr",
            "3e-3",
            "--log-json",
            log.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let losses: Vec<f64> =
        trainkit::read_losses(&log).unwrap().into_iter().map(f64::from).collect();
    let (first, last) =
        (losses[..5].iter().sum::<f64>() / 5.0, losses[35..].iter().sum::<f64>() / 5.0);
    assert!(last < first - 1.0, "loss went {first:.3} -> {last:.3}");
}

/// The shapes derived from a configuration (how the trainer refuses a `config.json` too large for
/// the machine before building it) are those of the model built.
#[test]
fn parameter_shapes_from_the_configuration_match_the_model() {
    testkit::checkpointing::assert_parameter_shapes_match_the_model::<Bert>(&Config::tiny(2, 32));
}
