//! Fine-tuning a published GPT-2 on a text file, offline: a hub cache holding what the hub serves
//! for `gpt2` (a bare `GPT2Model` snapshot without `lm_head.weight`, config.json, tokenizer.json)
//! and `--text` through that tokenizer; the loss falls. Without a tokenizer, `--text` is refused.

use candle_core::{Device, Tensor};
use datasets::tokenizer::{Kind, Tokenizer};
use gpt2::{Config, Gpt2};
use std::collections::HashMap;
use trainable::Model;

#[test]
fn a_published_checkpoint_fine_tunes_on_text() {
    let dir = std::env::temp_dir().join(format!("gpt2-text-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = datasets::text::synthetic_corpus(11, 60_000);
    let text_path = dir.join("train.txt");
    std::fs::write(&text_path, &text).unwrap();

    let snapshot = trainkit::hub::cache_folder(&dir.join("hub"), "someone/tiny-gpt2").unwrap();
    Tokenizer::train(Kind::ByteLevelBpe, &text, 320, &snapshot.join("tokenizer.json")).unwrap();
    let config = Config { vocab_size: 320, ..Config::tiny(2, 32) };
    let published = Gpt2::new(config.clone(), &Device::Cpu, 1).unwrap();
    let tensors: HashMap<String, Tensor> =
        published.params().named().map(|(n, v)| (n.to_string(), v.as_tensor().clone())).collect();
    assert!(!tensors.contains_key("lm_head.weight"));
    candle_core::safetensors::save(&tensors, snapshot.join("model.safetensors")).unwrap();
    std::fs::write(snapshot.join("config.json"), serde_json::to_string(&config).unwrap()).unwrap();

    let (cache, text_path) = (dir.join("hub"), text_path.to_str().unwrap());
    let (losses, log) = testkit::run_logged(
        env!("CARGO_BIN_EXE_train-gpt2"),
        &[
            "--model-id",
            "someone/tiny-gpt2",
            "--offline",
            "--hub-cache",
            cache.to_str().unwrap(),
            "--text",
            text_path,
            "--steps",
            "20",
            "--batch",
            "8",
            "--seq",
            "32",
            "--lr",
            "3e-3",
        ],
    );
    assert!(
        log.contains("weights from") && log.contains("tokens by") && !log.contains("initialised"),
        "{log}"
    );
    testkit::assert_loss_falls(&losses, 0.5, "train-gpt2 --model-id --text");

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_train-gpt2"))
        .args(["--preset", "tiny", "--steps", "1", "--text", text_path])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--text needs a tokenizer"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
