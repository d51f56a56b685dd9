//! BERT is dropout-heavy: the strictest test of RNG replay. Gradients and losses under every
//! policy equal `off` bit for bit over two steps, on full-length sequences and on padded batches
//! (attention masks in every layer), and every parameter learns.

use bert::{Bert, Config, MlmData};
use candle_core::Device;
use candle_nn::Optimizer;
use model::Model;
use model::Precision;
use optim::{AdamW, ParamsAdamW};
use remat::{Executor, Policy};
use std::collections::BTreeMap;

type Trace = Vec<(u32, BTreeMap<String, Vec<u32>>)>;

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

fn train(policy: &str, replay_rng: bool) -> Trace {
    train_on(policy, replay_rng, false, Precision::F32)
}

fn train_on(policy: &str, replay_rng: bool, padded: bool, dtype: Precision) -> Trace {
    let cfg = Config { dtype, ..Config::tiny(6, 32) };
    let (batch, seq) = (2, 24);
    let model = Bert::new(cfg.clone(), &Device::Cpu, 42).unwrap();
    let mut exec =
        Executor::new(model.graph(), &policy.parse::<Policy>().unwrap(), model.params().vars(), 7)
            .unwrap();
    if !replay_rng {
        exec = exec.without_rng_replay();
    }
    let mut opt =
        AdamW::new(model.params().vars(), ParamsAdamW { lr: 1e-3, ..Default::default() }).unwrap();
    let data = data(padded, cfg.vocab_size, seq);
    (0..2u64)
        .map(|step| {
            let m = data.batch(step, batch);
            assert_eq!(
                padded,
                m.attention_mask.contains(&0.0),
                "padded batches must hold padding, full-length ones none"
            );
            let out = exec.step(&model.inputs(&m, &Device::Cpu).unwrap(), step).unwrap();
            opt.step(&out.grads).unwrap();
            (
                out.loss
                    .to_dtype(candle_core::DType::F32)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
                    .to_bits(),
                model.params().grad_bits(&out.grads).unwrap(),
            )
        })
        .collect()
}

#[test]
fn gradients_equal_off_bit_for_bit() {
    for padded in [false, true] {
        assert_policies_match_off(padded, Precision::F32);
    }
}

/// The same in mixed precision, on padded batches.
#[test]
fn half_precision_gradients_equal_off_bit_for_bit() {
    for dtype in [Precision::Bf16, Precision::F16, Precision::Bf16Weights] {
        assert_policies_match_off(true, dtype);
    }
}

fn assert_policies_match_off(padded: bool, dtype: Precision) {
    let off = train_on("off", true, padded, dtype);
    for policy in [
        "sqrt",
        "every-two-blocks",
        "every-n=1",
        "sqrt+keep=matmul+attention",
        "every-n=1+keep=matmul",
    ] {
        let run = train_on(policy, true, padded, dtype);
        for (step, (a, b)) in off.iter().zip(&run).enumerate() {
            assert_eq!(
                a.0, b.0,
                "{policy} (padded: {padded}, {dtype}): loss differs at step {step}"
            );
            assert_eq!(a.1.len(), b.1.len(), "{policy}");
            for (name, g) in &a.1 {
                assert!(
                    g == &b.1[name],
                    "{policy} (padded: {padded}, {dtype}): gradient of {name} differs at step \
                     {step}"
                );
            }
        }
    }
}

#[test]
fn without_rng_replay_the_gradients_differ() {
    let (off, run) = (train("off", true), train("every-two-blocks", false));
    assert!(off[0].1.iter().any(|(n, g)| g != &run[0].1[n]), "replay off must break bit-exactness");
}

#[test]
fn every_parameter_receives_a_nonzero_gradient() {
    let n = Bert::new(Config::tiny(6, 32), &Device::Cpu, 42).unwrap().params().vars().len();
    for policy in ["off", "sqrt", "every-two-blocks"] {
        for (_, grads) in train(policy, true) {
            assert_eq!(grads.len(), n, "{policy}: some parameters got no gradient");
            for (name, g) in grads {
                assert!(
                    g.iter().any(|&b| f32::from_bits(b) != 0.0),
                    "{policy}: gradient of {name} is all zero"
                );
            }
        }
    }
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
