//! `train-llama` as a user runs it: a published checkpoint's files (`config.json`, a bf16
//! `model.safetensors`, a byte-level BPE `tokenizer.json`, written here for each of the four
//! architectures) fine-tuned on plain text with LoRA under checkpointing, the adapter written in
//! PEFT's layout; a resume bit-identical to a straight run; configurations it does not implement
//! refused naming the key.

use candle_core::{DType, Device};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use trainable::Model;

const BIN: &str = env!("CARGO_BIN_EXE_train-llama");

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("llama-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

/// A tiny published-style checkpoint of `architecture` in `dir`: its config.json, its weights in
/// bf16 as checkpoints are published, and a tokenizer trained on `text`.
fn checkpoint(dir: &Path, architecture: &str, text: &str) {
    let json = serde_json::json!({
        "architectures": [architecture], "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": architecture != "LlamaForCausalLM",
        "hidden_act": "silu", "torch_dtype": "bfloat16",
    });
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    let config = llama::Config::from_json_text(&json.to_string()).unwrap();
    let model = llama::Llama::new(config, &Device::Cpu, 9).unwrap();
    let bf16 = model
        .params()
        .tensors()
        .into_iter()
        .map(|(name, t)| (name, t.to_dtype(DType::BF16).unwrap()))
        .collect();
    params::write_snapshot(&dir.join("model.safetensors"), &bf16, Default::default()).unwrap();
    let kind = datasets::tokenizer::Kind::ByteLevelBpe;
    datasets::tokenizer::Tokenizer::train(kind, text, 300, &dir.join("tokenizer.json")).unwrap();
}

/// Each architecture's checkpoint fine-tunes with LoRA on text (the tokenizer found beside
/// `--config`), under `sqrt`, its loss finite and the adapter written as PEFT writes one.
#[test]
fn each_architecture_fine_tunes_with_lora_from_published_files() {
    let dir = scratch("lora");
    let text = "the adapters learn while the base stays frozen in bf16. ".repeat(40);
    std::fs::write(dir.join("a.txt"), &text).unwrap();
    for architecture in
        ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
    {
        let model = dir.join(architecture);
        std::fs::create_dir_all(&model).unwrap();
        checkpoint(&model, architecture, &text);
        let s = |p: PathBuf| p.to_str().unwrap().to_string();
        let adapter = model.join("adapter");
        let out = run(&[
            "--config",
            &s(model.join("config.json")),
            "--init",
            &s(model.join("model.safetensors")),
            "--text",
            &s(dir.join("a.txt")),
            "--seq",
            "32",
            "--steps",
            "3",
            "--dtype",
            "bf16-weights",
            "--lora",
            "4",
            "--lora-dropout",
            "0.1",
            "--policy",
            "sqrt",
            "--save-adapter",
            &s(adapter.clone()),
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{architecture}: {err}");
        assert!(err.contains("tokenizer.json") && err.contains("step    2  loss"), "{err}");
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(config["peft_type"], "LORA");
        assert_eq!(config["task_type"], "CAUSAL_LM");
        assert_eq!(config["r"], 4);
        assert_eq!(config["target_modules"].as_array().unwrap().len(), 7);
        let (tensors, _) =
            params::read_snapshot(&adapter.join("adapter_model.safetensors"), &Device::Cpu)
                .unwrap();
        let key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight";
        assert!(tensors.contains_key(key), "{architecture}: no {key} in the adapter");
        assert_eq!(tensors.len(), 2 * 7 * 2, "{architecture}: the adapters alone");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A resumed run's losses and final weights equal a straight run's, bit for bit.
#[test]
fn a_resume_is_bit_identical() {
    testkit::cli::assert_resume_is_bit_identical(BIN, &["--preset", "tiny", "--seq", "32"]);
}

/// A configuration with a feature this crate does not implement is refused naming the key,
/// before anything is built; so is a sequence beyond Mistral's window.
#[test]
fn configurations_not_implemented_are_refused_naming_the_key() {
    let dir = scratch("refused");
    let config = dir.join("config.json");
    let base = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 128,
    });
    for (key, value, said) in [
        (
            "architectures",
            serde_json::json!(["GemmaForCausalLM"]),
            "architectures GemmaForCausalLM",
        ),
        ("hidden_act", serde_json::json!("gelu"), "hidden_act \"gelu\" is not implemented"),
        ("num_local_experts", serde_json::json!(8), "num_local_experts 8 is not implemented"),
        ("rope_scaling", serde_json::json!({"rope_type": "yarn", "factor": 4.0}), "\"yarn\""),
        ("attention_bias", serde_json::json!(true), "attention_bias true"),
        (
            "num_key_value_heads",
            serde_json::json!(3),
            "num_attention_heads (4) must be a positive multiple of num_key_value_heads (3)",
        ),
        ("sliding_window", serde_json::json!(16), "beyond the model's sliding_window (16)"),
    ] {
        let mut json = base.clone();
        json[key] = value;
        std::fs::write(&config, json.to_string()).unwrap();
        let out = run(&["--config", config.to_str().unwrap(), "--seq", "32", "--steps", "1"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && !err.contains("panicked") && err.contains(said),
            "{key}: {err}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The first step's loss of `train-llama args` (it must succeed).
fn first_loss(args: &[&str]) -> String {
    let out = run(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {err}");
    let line = err.lines().find(|l| l.starts_with("step    0  loss")).expect(&err);
    line.split_whitespace().nth(3).unwrap().to_string()
}

/// A sharded checkpoint (`model.safetensors.index.json` and the shards it names, as Llama-3.2-3B
/// and larger are published) loads through its index, from a folder and from the hub cache
/// offline, and trains from exactly the weights the single file holds.
#[test]
fn a_sharded_checkpoint_loads_as_the_single_file_does() {
    let dir = scratch("sharded");
    let text = "a sharded checkpoint is its index and its shards. ".repeat(40);
    std::fs::write(dir.join("a.txt"), &text).unwrap();
    let single = dir.join("single");
    std::fs::create_dir_all(&single).unwrap();
    checkpoint(&single, "Qwen2ForCausalLM", &text);
    let hub = dir.join("hub");
    let sharded = trainkit::hub::cache_folder(&hub, "someone/tiny-qwen").unwrap();
    for file in ["config.json", "tokenizer.json"] {
        std::fs::copy(single.join(file), sharded.join(file)).unwrap();
    }
    let (tensors, _) =
        params::read_snapshot(&single.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut weight_map = serde_json::Map::new();
    for (i, part) in names.chunks(names.len().div_ceil(2)).enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", i + 1);
        let shard = part.iter().map(|n| (n.to_string(), tensors[*n].clone())).collect();
        params::write_snapshot(&sharded.join(&file), &shard, Default::default()).unwrap();
        weight_map.extend(part.iter().map(|n| (n.to_string(), file.clone().into())));
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(sharded.join("model.safetensors.index.json"), index.to_string()).unwrap();

    let s = |p: PathBuf| p.to_str().unwrap().to_string();
    let common = ["--text", &s(dir.join("a.txt")), "--seq", "32", "--steps", "1"];
    let from = |weights: &Path| {
        let config = s(single.join("config.json"));
        first_loss(
            &[&["--config", &config, "--init", &s(weights.to_path_buf())][..], &common].concat(),
        )
    };
    let want = from(&single.join("model.safetensors"));
    assert_eq!(from(&sharded.join("model.safetensors.index.json")), want, "from the index");
    let hub_args = ["--model-id", "someone/tiny-qwen", "--hub-cache", &s(hub.clone()), "--offline"];
    assert_eq!(first_loss(&[&hub_args[..], &common].concat()), want, "from the hub cache");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The shared training paths run for the Llama family as for every trainer: accumulation, the
/// optimizer inside backward, the planner's `budget=` and `auto`, full fine-tuning in bf16.
#[test]
fn the_shared_training_paths_run() {
    let tiny = ["--preset", "tiny", "--seq", "32", "--steps", "2"];
    for extra in [
        &["--accumulate", "2"][..],
        &["--optimizer-in-backward", "--policy", "every-n=1"],
        &["--policy", "auto"],
        &["--policy", "sqrt+keep=attention", "--dtype", "bf16"],
    ] {
        let out = run(&[&tiny[..], extra].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && err.contains("step    1  loss"), "{extra:?}: {err}");
    }
}

/// `--packing lines`: each line of the text one example, right-padded, the padding skipped by the
/// loss (tests/padding.rs shows it skipped); without `--text` the flag is refused.
#[test]
fn lines_of_a_text_train_as_padded_examples() {
    let dir = scratch("lines");
    let text: String =
        (0..60).map(|i| format!("example {i} says {}\n", "more ".repeat(i % 7))).collect();
    std::fs::write(dir.join("a.txt"), &text).unwrap();
    checkpoint(&dir, "LlamaForCausalLM", &text);
    let s = |p: PathBuf| p.to_str().unwrap().to_string();
    let out = run(&[
        "--config",
        &s(dir.join("config.json")),
        "--text",
        &s(dir.join("a.txt")),
        "--packing",
        "lines",
        "--seq",
        "16",
        "--steps",
        "2",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("step    1  loss"), "{err}");
    assert!(err.contains("in 60 examples of at most 17 tokens"), "{err}");
    let out = run(&["--preset", "tiny", "--packing", "lines", "--steps", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--text"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
