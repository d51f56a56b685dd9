//! Checkpointing must not change training: gradients and losses under every policy equal `off`
//! bit for bit (dropout on), every parameter gets a gradient, and `sqrt` saves memory.

use candle_core::Device;
use candle_nn::Optimizer;
use datasets::tokens::Batcher;
use gpt2::{Config, Gpt2};
use optim::{AdamW, ParamsAdamW};
use remat::{Executor, Policy};
use testkit::checkpointing::{Control, Training};
use trainable::{Model, Precision};

fn batcher(cfg: &Config, seq: usize) -> Batcher {
    let text = datasets::text::synthetic_corpus(1, 100_000);
    Batcher::new(datasets::text::byte_tokens(&text), seq, cfg.vocab_size, 1).unwrap()
}

/// A tiny GPT-2 with dropout 0.1, activations in `dtype`, trained with AdamW on batches of 2 x 32.
fn check(dtype: Precision, run: impl FnOnce(&Training<Gpt2>)) {
    let cfg = Config { dtype, ..Config::tiny(8, 32) };
    let data = batcher(&cfg, 32);
    let build = || Gpt2::new(cfg.clone(), &Device::Cpu, 42).unwrap();
    let inputs = |model: &Gpt2, step: u64| {
        let (x, y) = data.batch(step, 2);
        model.inputs(&x, &y, 2, 32, &Device::Cpu).unwrap()
    };
    let optimizer = trainable::OptimizerKind::Adamw;
    run(&Training { build: &build, inputs: &inputs, optimizer, lr: 1e-3, seed: 7 })
}

/// In bf16 and f16 too (the parameters and their gradients f32, the activations half), and in
/// bf16-weights (parameters and gradients bf16 as well), every policy equals `off` bit for bit,
/// and every parameter gets a non-zero gradient.
#[test]
fn gradients_equal_off_bit_for_bit_in_half_precision() {
    for dtype in [Precision::Bf16, Precision::F16, Precision::Bf16Weights] {
        check(dtype, |t| {
            t.assert_every_parameter_learns(&["off"], &dtype.to_string());
            let policies = ["sqrt", "every-two-blocks", "sqrt+keep=matmul+attention"];
            t.assert_policies_equal_off(&policies, &dtype.to_string());
        });
    }
}

#[test]
fn gradients_equal_off_bit_for_bit() {
    let policies = [
        "sqrt",
        "every-two-blocks",
        "every-n=1",
        "explicit=3",
        "sqrt+keep=matmul+attention",
        "every-n=1+keep=matmul",
    ];
    check(Precision::F32, |t| t.assert_policies_equal_off(&policies, "f32"));
}

/// Step 0's forward is identical; the recompute draws new dropout masks, so gradients differ.
#[test]
fn without_rng_replay_the_gradients_differ() {
    check(Precision::F32, |t| t.assert_control_breaks("sqrt", Control::NoRngReplay));
}

#[test]
fn every_parameter_receives_a_nonzero_gradient() {
    let policies = ["off", "sqrt", "every-two-blocks", "sqrt+keep=matmul"];
    check(Precision::F32, |t| t.assert_every_parameter_learns(&policies, "f32"));
}

/// Under `bf16-weights` the parameters and their gradients are bf16 (2 bytes each, no f32 copy)
/// and AdamW's moments f32.
#[test]
fn bf16_weights_keep_bf16_parameters_and_gradients_and_f32_moments() {
    let cfg = Config { dtype: trainable::Precision::Bf16Weights, ..Config::tiny(8, 32) };
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
