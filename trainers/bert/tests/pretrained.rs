//! Starting from published checkpoints and training on real text: a bare `BertModel` snapshot (no
//! masked-LM head) loads with the head initialised and named, `--strict` refuses it; `--text` goes
//! through a `tokenizer.json` exactly as the `tokenizers` crate encodes it, and the loss falls.

use bert::{Bert, Config, MlmData};
use candle_core::{Device, Tensor};
use datasets::tokenizer::{Kind, Tokenizer};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use trainable::Model;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bert-pretrained-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes `model` as a sentence-transformers-style bare `BertModel` (names without `bert.`, a
/// pooler, no `cls.` head) with its config.json into `dir`; returns the weights' path.
fn write_headless(model: &Bert, dir: &Path) -> PathBuf {
    let mut tensors: HashMap<String, Tensor> = model
        .params()
        .named()
        .filter(|(n, _)| !n.starts_with("cls."))
        .map(|(n, v)| (n.strip_prefix("bert.").unwrap().to_string(), v.as_tensor().clone()))
        .collect();
    let c = model.config.hidden_size;
    tensors.insert(
        "pooler.dense.weight".into(),
        Tensor::zeros((c, c), candle_core::DType::F32, &Device::Cpu).unwrap(),
    );
    let path = dir.join("model.safetensors");
    candle_core::safetensors::save(&tensors, &path).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_string(&model.config).unwrap()).unwrap();
    path
}

fn hidden(model: &Bert) -> Vec<f32> {
    let ids = Tensor::new(&[[2u32, 7, 9, 4, 3]], &Device::Cpu).unwrap();
    model
        .hidden_states(&ids, None, None, remat::RunMode::Eval)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn head(model: &Bert) -> Vec<Vec<f32>> {
    model
        .params()
        .named()
        .filter(|(n, _)| n.starts_with("cls."))
        .map(|(_, v)| v.as_tensor().flatten_all().unwrap().to_vec1().unwrap())
        .collect()
}

#[test]
fn a_headless_checkpoint_loads_with_the_head_initialised() {
    let dir = temp_dir("headless");
    let published = Bert::new(Config::tiny(2, 32), &Device::Cpu, 1).unwrap();
    let weights = write_headless(&published, &dir);

    let model = Bert::new(Config::tiny(2, 32), &Device::Cpu, 2).unwrap();
    let fresh = model.init_from(&weights, false).unwrap();
    let names: Vec<&str> = fresh.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "cls.predictions.bias",
            "cls.predictions.transform.LayerNorm.bias",
            "cls.predictions.transform.LayerNorm.weight",
            "cls.predictions.transform.dense.bias",
            "cls.predictions.transform.dense.weight"
        ]
    );
    assert_eq!(hidden(&model), hidden(&published), "the encoder is the snapshot's");
    assert_eq!(
        head(&model),
        head(&Bert::new(Config::tiny(2, 32), &Device::Cpu, 2).unwrap()),
        "the head keeps its initial values"
    );
    let err = model.init_from(&weights, true).unwrap_err().to_string();
    assert!(err.contains("cls.predictions") && err.contains("missing"), "{err}");

    // The trainer says what it initialised; with --strict it refuses.
    let config = dir.join("config.json");
    let args = [
        "--config",
        config.to_str().unwrap(),
        "--init",
        weights.to_str().unwrap(),
        "--steps",
        "1",
        "--seq",
        "16",
    ];
    let out = Command::new(env!("CARGO_BIN_EXE_train-bert")).args(args).output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success()
            && log.contains("initialised, not loaded (5 task-head tensors)")
            && log.contains("cls.predictions.bias (absent)"),
        "{log}"
    );
    let out =
        Command::new(env!("CARGO_BIN_EXE_train-bert")).args(args).arg("--strict").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--strict") && err.contains("is missing"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn text_through_a_tokenizer_trains_and_the_loss_falls() {
    let dir = temp_dir("text");
    let text = datasets::text::synthetic_corpus(11, 60_000);
    let text_path = dir.join("train.txt");
    std::fs::write(&text_path, &text).unwrap();
    let tok_path = dir.join("tokenizer.json");
    let tokenizer = Tokenizer::train(Kind::WordPiece, &text, 300, &tok_path).unwrap();

    // Every row is [CLS] + a line's ids as the tokenizers crate gives them (cut to 30) + [SEP].
    let (seq, direct) = (32, tokenizers::Tokenizer::from_file(&tok_path).unwrap());
    let lines: Vec<Vec<u32>> =
        text.lines().map(|l| direct.encode(l, false).unwrap().get_ids().to_vec()).collect();
    let data = MlmData::tokenized(&text, &tokenizer, 512, seq, 0).unwrap();
    let b = data.batch(0, 4);
    let (cls, sep, pad) = (data.specials.cls, data.specials.sep, data.specials.pad);
    for row in b.labels.chunks(b.seq) {
        let body: Vec<u32> = row.iter().copied().skip(1).take_while(|&t| t != sep).collect();
        assert_eq!(row[0], cls);
        assert!(
            lines.iter().any(|l| l.chunks(seq - 2).any(|piece| piece == body.as_slice())),
            "a row that is no piece of a line: {body:?}"
        );
        assert!(row[body.len() + 2..].iter().all(|&t| t == pad));
    }
    // What memory plans are made for: the same rows, padded to the whole --seq.
    let full = data.full_length_batch(0, 4);
    assert_eq!(
        (full.seq, full.attention_mask.iter().filter(|&&m| m == 1.0).count()),
        (seq, b.attention_mask.iter().filter(|&&m| m == 1.0).count())
    );

    let (losses, log) = testkit::run_logged(
        env!("CARGO_BIN_EXE_train-bert"),
        &[
            "--preset",
            "tiny",
            "--text",
            text_path.to_str().unwrap(),
            "--tokenizer",
            tok_path.to_str().unwrap(),
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
    assert!(log.contains("tokenized by"), "{log}");
    testkit::assert_loss_falls(&losses, 0.5, "train-bert --text");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A `tokenizer.json` as sentence-transformers and many BERT checkpoints publish it: padding to 128
/// and truncation at 128 set. Were those settings honoured, every line would come back as 128 ids
/// (mostly `[PAD]`, fed as tokens with mask 1), a longer document would be cut, and at `--seq 32` a
/// batch of padding alone would have nothing to score: `step 0 loss NaN`.
#[test]
fn a_published_tokenizer_with_padding_and_truncation_set_trains() {
    let dir = temp_dir("published-tokenizer");
    // Short lines and one document of about 200 words, longer than the truncation length.
    let short = datasets::text::synthetic_corpus(5, 20_000);
    let long = short.split_whitespace().take(200).collect::<Vec<_>>().join(" ");
    let text = format!("{long}\n{short}");
    let text_path = dir.join("train.txt");
    std::fs::write(&text_path, &text).unwrap();
    let tok_path = dir.join("tokenizer.json");
    Tokenizer::train(Kind::WordPiece, &text, 300, &tok_path).unwrap();
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tok_path).unwrap()).unwrap();
    json["padding"] = serde_json::json!({
        "strategy": {"Fixed": 128}, "direction": "Right", "pad_to_multiple_of": null, "pad_id": 0,
        "pad_type_id": 0, "pad_token": "[PAD]",
    });
    json["truncation"] = serde_json::json!({
        "direction": "Right", "max_length": 128, "strategy": "LongestFirst", "stride": 0,
    });
    std::fs::write(&tok_path, json.to_string()).unwrap();

    let tokenizer = Tokenizer::from_file(&tok_path).unwrap();
    let pad = tokenizer.token_id("[PAD]").unwrap();
    let first = &tokenizer.encode_lines(&text).unwrap()[0];
    assert!(
        first.len() > 128 && !first.contains(&pad),
        "the long document came back as {} ids, padding included or cut",
        first.len()
    );
    // `train-gpt2 --text` encodes its text in one piece, through the same call.
    assert_eq!(tokenizer.encode(&long).unwrap().len(), first.len());
    // Every batch: no [PAD] attended to, something to score in every row.
    let data = MlmData::tokenized(&text, &tokenizer, 512, 32, 0).unwrap();
    for step in 0..50 {
        let b = data.batch(step, 4);
        for (ids, (mask, weights)) in
            b.labels.chunks(b.seq).zip(b.attention_mask.chunks(b.seq).zip(b.weights.chunks(b.seq)))
        {
            assert!(
                ids.iter().zip(mask).all(|(&id, &m)| (id == pad) == (m == 0.0)),
                "step {step}: a [PAD] attended to, or a token masked out"
            );
            assert!(weights.contains(&1.0), "step {step}: a row with nothing to score");
        }
    }

    let (losses, _) = testkit::run_logged(
        env!("CARGO_BIN_EXE_train-bert"),
        &[
            "--preset",
            "tiny",
            "--text",
            text_path.to_str().unwrap(),
            "--tokenizer",
            tok_path.to_str().unwrap(),
            "--steps",
            "8",
            "--batch",
            "4",
            "--seq",
            "32",
        ],
    );
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A masked-LM batch whose weights are all zero (nothing to score) is refused with an error that
/// says so, where the mean over no position would be NaN (as PyTorch's is).
#[test]
fn a_cross_entropy_with_no_weight_is_refused() {
    let logits = Tensor::zeros((3, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
    let targets = Tensor::new(&[0u32, 1, 2], &Device::Cpu).unwrap();
    let weights = Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu).unwrap();
    let err = ops::fused::cross_entropy(&logits, &targets, Some(&weights)).unwrap_err().to_string();
    assert!(err.contains("every weight is zero"), "{err}");
}

/// Documents of special tokens alone (a line of `[UNK]`s, a literal `[PAD]`) have nothing to
/// predict: dropped, and data of nothing else is refused.
#[test]
fn documents_with_nothing_to_predict_are_dropped() {
    let dir = temp_dir("specials-only");
    let text = datasets::text::synthetic_corpus(6, 5_000);
    let tok_path = dir.join("tokenizer.json");
    let tokenizer = Tokenizer::train(Kind::WordPiece, &text, 300, &tok_path).unwrap();
    let err = MlmData::tokenized("[PAD] [PAD]\n[UNK]\n", &tokenizer, 512, 32, 0)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("no document has a token to predict"), "{err}");
    let data = MlmData::tokenized(&format!("[PAD] [PAD]\n{text}"), &tokenizer, 512, 32, 0).unwrap();
    for step in 0..20 {
        let b = data.batch(step, 4);
        assert!(b.weights.chunks(b.seq).all(|w| w.contains(&1.0)), "step {step}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
