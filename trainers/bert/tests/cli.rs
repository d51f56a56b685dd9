//! `train-bert` refuses options it would not use instead of ignoring them.

fn fails_saying(args: &[&str], needle: &str) {
    let out =
        std::process::Command::new(env!("CARGO_BIN_EXE_train-bert")).args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && !err.contains("panicked") && err.contains(needle),
        "{args:?}: {err}"
    );
}

/// Options that would go unused are refused. Unchecked, `--vocab` without text data would print the
/// synthetic corpus's vocabulary size and train a random model without a word about the file it
/// was given; each of the others would be as silent.
#[test]
fn options_that_would_go_unused_are_refused() {
    let tiny = ["--preset", "tiny", "--steps", "1"];
    for (extra, needle) in [
        (&["--vocab", "vocab.txt"][..], "--text"),
        (&["--tokenizer", "tokenizer.json"], "--text"),
        (&["--hub-cache", "/tmp"], "--model-id"),
        (&["--offline"], "--model-id"),
        (&["--strict"], "none were given (--init or --model-id)"),
        (&["--eval-batches", "4"], "--eval-every"),
        (&["--config", "config.json"], "cannot be used with"),
        (&["--text", "a.txt", "--vocab", "v.txt", "--tokenizer", "t.json"], "cannot be used with"),
    ] {
        fails_saying(&[&tiny[..], extra].concat(), needle);
    }
    fails_saying(
        &["--model-id", "someone/x", "--init", "w.safetensors", "--offline"],
        "cannot be used with",
    );
}

/// Every file `train-bert` reads is spared by every output it writes: weights, training
/// snapshot, configuration, text, the tokenizer found beside `--config`, and a vocabulary. A
/// snapshot may replace the weights it continues, so those meet `--log-json`.
#[test]
fn every_file_read_is_spared_by_every_output() {
    use datasets::tokenizer::{Kind, Tokenizer};
    use testkit::cli::{assert_outputs_spare_inputs, ReadFile};
    let bin = env!("CARGO_BIN_EXE_train-bert");
    let dir = std::env::temp_dir().join(format!("bert-spared-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("model")).unwrap();
    let at = |name: &str| dir.join(name);
    let s = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let (w, train_w) = (s("w.safetensors"), s("w.train.safetensors"));
    let tiny = ["--preset", "tiny", "--seq", "16", "--steps", "1"];
    let out = std::process::Command::new(bin)
        .args(tiny)
        .args(["--save", &w, "--save-every", "1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = datasets::text::synthetic_corpus(5, 4000);
    std::fs::write(at("a.txt"), &text).unwrap();
    Tokenizer::train(Kind::WordPiece, &text, 300, &at("model/tokenizer.json")).unwrap();
    let config = bert::Config::tiny(2, 32);
    std::fs::write(at("model/config.json"), serde_json::to_string(&config).unwrap()).unwrap();
    let words: Vec<&str> = text.split_whitespace().take(50).collect();
    let vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"].iter().chain(&words);
    std::fs::write(at("vocab.txt"), vocab.copied().collect::<Vec<_>>().join("\n")).unwrap();
    let (config, text, vocab) = (s("model/config.json"), s("a.txt"), s("vocab.txt"));
    let (all, log) = (&["--save", "--log-json"][..], &["--log-json"][..]);
    let with_config = ["--config", &config, "--seq", "16", "--steps", "1", "--text", &text];
    let with_vocab = [&tiny[..], &["--text", &text, "--vocab", &vocab]].concat();
    let reads = [
        ReadFile::new(&[&tiny[..], &["--init", &w]].concat(), &at("w.safetensors"), log),
        ReadFile::new(
            &[&tiny[..], &["--resume", &train_w]].concat(),
            &at("w.train.safetensors"),
            log,
        ),
        ReadFile::new(&with_config, &at("model/config.json"), all),
        ReadFile::new(&with_config, &at("a.txt"), all),
        ReadFile::new(&with_config, &at("model/tokenizer.json"), all),
        ReadFile::new(&with_vocab, &at("vocab.txt"), all),
    ];
    assert_outputs_spare_inputs(bin, &[], &reads);
    std::fs::remove_dir_all(&dir).unwrap();
}
