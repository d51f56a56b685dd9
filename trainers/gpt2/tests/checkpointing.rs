//! Checkpointing must not change training: gradients and losses under every policy equal `off`
//! bit for bit (dropout on), every parameter gets a gradient, and `sqrt` saves memory.

use candle_core::Device;
use candle_nn::Optimizer;
use datasets::tokens::Batcher;
use gpt2::{Config, Gpt2};
use model::Model;
use optim::{AdamW, ParamsAdamW};
use remat::{Executor, Policy};
use std::collections::BTreeMap;

/// Per step: the loss's bits and every parameter's gradient bits, by name.
type Trace = Vec<(u32, BTreeMap<String, Vec<u32>>)>;

fn batcher(cfg: &Config, seq: usize) -> Batcher {
    let text = datasets::text::synthetic_corpus(1, 100_000);
    Batcher::new(datasets::text::byte_tokens(&text), seq, cfg.vocab_size, 1).unwrap()
}

/// Two training steps of a tiny GPT-2 with dropout 0.1 under `policy`.
fn train(policy: &str, replay_rng: bool) -> Trace {
    train_in(policy, replay_rng, model::Precision::F32)
}

/// [`train`] with activations in `dtype`.
fn train_in(policy: &str, replay_rng: bool, dtype: model::Precision) -> Trace {
    let cfg = Config { dtype, ..Config::tiny(8, 32) };
    let (batch, seq) = (2, 32);
    let model = Gpt2::new(cfg.clone(), &Device::Cpu, 42).unwrap();
    let mut exec =
        Executor::new(model.graph(), &policy.parse::<Policy>().unwrap(), model.params().vars(), 7)
            .unwrap();
    if !replay_rng {
        exec = exec.without_rng_replay();
    }
    let mut opt =
        AdamW::new(model.params().vars(), ParamsAdamW { lr: 1e-3, ..Default::default() }).unwrap();
    let data = batcher(&cfg, seq);
    (0..2u64)
        .map(|step| {
            let (x, y) = data.batch(step, batch);
            let out =
                exec.step(&model.inputs(&x, &y, batch, seq, &Device::Cpu).unwrap(), step).unwrap();
            opt.step(&out.grads).unwrap();
            let grads = model.params().grad_bits(&out.grads).unwrap();
            (out.loss.to_scalar::<f32>().unwrap().to_bits(), grads)
        })
        .collect()
}

fn n_params() -> usize {
    Gpt2::new(Config::tiny(8, 32), &Device::Cpu, 42).unwrap().params().vars().len()
}

/// In bf16 and f16 too (the parameters and their gradients f32, the activations half), and in
/// bf16-weights (parameters and gradients bf16 as well), every
/// policy equals `off` bit for bit, and every parameter gets a non-zero gradient.
#[test]
fn gradients_equal_off_bit_for_bit_in_half_precision() {
    for dtype in [model::Precision::Bf16, model::Precision::F16, model::Precision::Bf16Weights] {
        let off = train_in("off", true, dtype);
        assert_eq!(off[0].1.len(), n_params(), "{dtype}: a parameter got no gradient");
        for (name, g) in &off[0].1 {
            assert!(
                g.iter().any(|&x| f32::from_bits(x) != 0.0),
                "{dtype}: `{name}` got a zero gradient"
            );
        }
        for policy in ["sqrt", "every-two-blocks", "sqrt+keep=matmul+attention"] {
            assert!(
                train_in(policy, true, dtype) == off,
                "{dtype} {policy}: losses or gradients differ from off"
            );
        }
    }
}

#[test]
fn gradients_equal_off_bit_for_bit() {
    let off = train("off", true);
    for policy in [
        "sqrt",
        "every-two-blocks",
        "every-n=1",
        "explicit=3",
        "sqrt+keep=matmul+attention",
        "every-n=1+keep=matmul",
    ] {
        let run = train(policy, true);
        for (step, (a, b)) in off.iter().zip(&run).enumerate() {
            assert_eq!(a.0, b.0, "{policy}: loss differs from off at step {step}");
            assert_eq!(a.1.len(), b.1.len(), "{policy}: parameters with a gradient differ");
            for (name, g) in &a.1 {
                assert!(
                    g == &b.1[name],
                    "{policy}: gradient of {name} differs from off at step {step}"
                );
            }
        }
    }
}

#[test]
fn without_rng_replay_the_gradients_differ() {
    let off = train("off", true);
    let run = train("sqrt", false);
    // Step 0's forward is identical; the recompute draws new dropout masks, so gradients differ.
    let differing = off[0].1.iter().filter(|(name, g)| *g != &run[0].1[*name]).count();
    assert!(
        differing > 0,
        "switching RNG replay off must break bit-exactness, or the test cannot fail"
    );
}

#[test]
fn every_parameter_receives_a_nonzero_gradient() {
    let n = n_params();
    for policy in ["off", "sqrt", "every-two-blocks", "sqrt+keep=matmul"] {
        for (step, (_, grads)) in train(policy, true).iter().enumerate() {
            assert_eq!(grads.len(), n, "{policy}: some parameters got no gradient at step {step}");
            for (name, g) in grads {
                assert!(
                    g.iter().any(|&b| f32::from_bits(b) != 0.0),
                    "{policy}: gradient of {name} is all zero"
                );
            }
        }
    }
}

/// Under `bf16-weights` the parameters and their gradients are bf16 (2 bytes each, no f32 copy)
/// and AdamW's moments f32.
#[test]
fn bf16_weights_keep_bf16_parameters_and_gradients_and_f32_moments() {
    let cfg = Config { dtype: model::Precision::Bf16Weights, ..Config::tiny(8, 32) };
    let model = Gpt2::new(cfg.clone(), &Device::Cpu, 42).unwrap();
    let vars = model.params().vars();
    let exec =
        Executor::new(model.graph(), &"sqrt".parse::<Policy>().unwrap(), vars.clone(), 7).unwrap();
    let (x, y) = batcher(&cfg, 32).batch(0, 2);
    let out = exec.step(&model.inputs(&x, &y, 2, 32, &Device::Cpu).unwrap(), 0).unwrap();
    let mut opt = AdamW::new(vars.clone(), ParamsAdamW::default()).unwrap();
    opt.step(&out.grads).unwrap();
    for (name, var) in model.params().named() {
        assert_eq!(var.dtype(), candle_core::DType::BF16, "parameter `{name}`");
        assert_eq!(
            out.grads.get(var).map(|g| g.dtype()),
            Some(candle_core::DType::BF16),
            "gradient of `{name}`"
        );
    }
    let state = optim::TrainOptimizer::state(&opt).unwrap();
    assert!(state
        .iter()
        .filter(|(k, _)| *k != "step")
        .all(|(_, t)| t.dtype() == candle_core::DType::F32));
}
