//! BERT is dropout-heavy: the strictest test of RNG replay. Gradients and losses under every
//! policy equal `off` bit for bit over two steps, on full-length sequences and on padded batches
//! (attention masks in every layer), and every parameter learns.

use bert::{Bert, Config, MlmData};
use candle_core::Device;
use testkit::checkpointing::{Control, Training};
use trainable::Precision;

/// Lines of 3 to 30 words: cut at 22 tokens and padded per batch, rows differ in length.
fn ragged_text() -> String {
    let corpus = datasets::text::synthetic_corpus(5, 4000);
    let words: Vec<&str> = corpus.split_whitespace().collect();
    let mut at = 0;
    (0..40)
        .map(|i| {
            let n = 3 + (i * 7) % 28;
            at += n;
            words[at - n..at].join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn data(padded: bool, vocab_size: usize, seq: usize) -> MlmData {
    match padded {
        false => MlmData::synthetic(vocab_size, seq, 1).unwrap(),
        true => {
            let text = ragged_text();
            MlmData::words(&text, &datasets::text::WordVocab::build(&text), vocab_size, seq, 1)
                .unwrap()
        }
    }
}

/// A tiny BERT with dropout 0.1, activations in `dtype`, trained with AdamW on batches of 2 x 24,
/// `padded` (every batch holds padding) or full-length (none does).
fn check(padded: bool, dtype: Precision, run: impl FnOnce(&Training<Bert>)) {
    let cfg = Config { dtype, ..Config::tiny(6, 32) };
    let data = data(padded, cfg.vocab_size, 24);
    let build = || Bert::new(cfg.clone(), &Device::Cpu, 42).unwrap();
    let inputs = |model: &Bert, step: u64| {
        let m = data.batch(step, 2);
        assert_eq!(
            padded,
            m.attention_mask.contains(&0.0),
            "padded batches must hold padding, full-length ones none"
        );
        model.inputs(&m, &Device::Cpu).unwrap()
    };
    let optimizer = trainable::OptimizerKind::Adamw;
    run(&Training { build: &build, inputs: &inputs, optimizer, lr: 1e-3, seed: 7 })
}

const POLICIES: [&str; 5] = [
    "sqrt",
    "every-two-blocks",
    "every-n=1",
    "sqrt+keep=matmul+attention",
    "every-n=1+keep=matmul",
];

#[test]
fn gradients_equal_off_bit_for_bit() {
    for padded in [false, true] {
        check(padded, Precision::F32, |t| {
            t.assert_policies_equal_off(&POLICIES, &format!("padded: {padded}"))
        });
    }
}

/// The same in mixed precision, on padded batches.
#[test]
fn half_precision_gradients_equal_off_bit_for_bit() {
    for dtype in [Precision::Bf16, Precision::F16, Precision::Bf16Weights] {
        check(true, dtype, |t| t.assert_policies_equal_off(&POLICIES, &format!("padded, {dtype}")));
    }
}

#[test]
fn without_rng_replay_the_gradients_differ() {
    check(false, Precision::F32, |t| {
        t.assert_control_breaks("every-two-blocks", Control::NoRngReplay)
    });
}

#[test]
fn every_parameter_receives_a_nonzero_gradient() {
    let policies = ["off", "sqrt", "every-two-blocks"];
    check(false, Precision::F32, |t| t.assert_every_parameter_learns(&policies, "f32"));
}

#[test]
fn masking_follows_bert() {
    let data = MlmData::synthetic(512, 128, 3).unwrap();
    let m = data.batch(0, 64);
    let (mask, cls) = (data.specials.mask, data.specials.cls);
    let chosen: Vec<usize> = (0..m.weights.len()).filter(|&i| m.weights[i] == 1.0).collect();
    let frac = chosen.len() as f64 / (64.0 * 126.0);
    assert!((frac - 0.15).abs() < 0.01, "{frac} of the words chosen");
    let masked =
        chosen.iter().filter(|&&i| m.input_ids[i] == mask).count() as f64 / chosen.len() as f64;
    let kept = chosen.iter().filter(|&&i| m.input_ids[i] == m.labels[i]).count() as f64
        / chosen.len() as f64;
    assert!(
        (masked - 0.8).abs() < 0.03 && (kept - 0.1).abs() < 0.03,
        "masked {masked}, kept {kept}"
    );
    assert!(m.input_ids.chunks(128).all(|s| s[0] == cls && m.weights[0] == 0.0));
    assert_eq!(data.batch(0, 64).input_ids, m.input_ids, "masking is a function of the step");
    assert_ne!(data.batch(1, 64).input_ids, m.input_ids);
}
