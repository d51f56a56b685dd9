//! Adafactor against PyTorch's `torch.optim.Adafactor` (`tests/fixtures/adafactor.safetensors`,
//! written by `scripts/make_fixtures.py`): five steps of given gradients on a matrix, a stack of
//! matrices, a vector and a scalar; in every dtype, by the in-place path and by the composed one
//! (candle ops, what other devices run). Half-precision parameters keep f32 statistics.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;
use optim::{Adafactor, ParamsAdafactor};
use std::collections::HashMap;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/adafactor.safetensors");
const NAMES: [&str; 4] = ["matrix", "stack", "vector", "scalar"];

/// The optimizer settings the fixture was made with (the file's `config` metadata).
fn config() -> (ParamsAdafactor, usize) {
    let bytes = std::fs::read(FIXTURE).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    let c: serde_json::Value =
        serde_json::from_str(header["__metadata__"]["config"].as_str().unwrap()).unwrap();
    let f = |k: &str| c[k].as_f64().unwrap();
    let params = ParamsAdafactor {
        lr: f("lr"),
        beta2_decay: f("beta2_decay"),
        eps1: Some(f("eps1")),
        eps2: f("eps2"),
        d: f("d"),
        weight_decay: f("weight_decay"),
    };
    (params, c["steps"].as_u64().unwrap() as usize)
}

/// Runs the fixture's steps in `dtype` (by the composed path if `composed`); fails where a
/// parameter is further than `tol` (relative to max(1, |want|)) from PyTorch's after any step.
/// Returns the largest error seen.
fn follow(dtype: DType, composed: bool, tol: f64) -> f64 {
    let fx: HashMap<String, Tensor> =
        candle_core::safetensors::load(FIXTURE, &Device::Cpu).unwrap();
    let t = |name: String| fx[&format!("fixture.{name}")].to_dtype(dtype).unwrap();
    let (params, steps) = config();
    let vars: Vec<Var> =
        NAMES.iter().map(|n| Var::from_tensor(&t(format!("start.{n}"))).unwrap()).collect();
    let mut opt = Adafactor::new(vars.clone(), params).unwrap();
    if composed {
        opt = opt.composed();
    }
    let mut worst = 0f64;
    for step in 1..=steps {
        let mut grads = GradStore::default();
        for (n, v) in NAMES.iter().zip(&vars) {
            grads.insert(v.as_tensor(), t(format!("grad.{step}.{n}")));
        }
        opt.step(&grads).unwrap();
        for (n, v) in NAMES.iter().zip(&vars) {
            let got = v
                .as_tensor()
                .to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            let want = fx[&format!("fixture.after.{step}.{n}")]
                .to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            for (g, w) in got.iter().zip(&want) {
                let err = (g - w).abs() / w.abs().max(1.0);
                worst = worst.max(err);
                assert!(
                    err <= tol,
                    "{dtype:?} step {step} `{n}`: {g} vs PyTorch {w} (error {err:.2e})"
                );
            }
        }
    }
    eprintln!("{dtype:?} (composed: {composed}): largest error {worst:.2e}");
    worst
}

#[test]
fn follows_pytorch_in_f64_and_f32() {
    // The fixture stores f32: f64 can match it no closer than f32 rounding (6e-8).
    for composed in [false, true] {
        follow(DType::F64, composed, 2e-7);
        follow(DType::F32, composed, 1e-5);
    }
}

/// Half-precision parameters differ from PyTorch's f32 run by their own rounding (bf16 keeps 8
/// bits of mantissa, f16 11); the statistics are f32.
#[test]
fn follows_pytorch_in_half_precision() {
    for composed in [false, true] {
        follow(DType::F16, composed, 2e-3);
        follow(DType::BF16, composed, 2e-2);
    }
}

#[test]
fn half_precision_parameters_keep_f32_statistics() {
    let w = Var::from_tensor(&Tensor::zeros((30, 20), DType::BF16, &Device::Cpu).unwrap()).unwrap();
    let opt = Adafactor::new(vec![w], ParamsAdafactor::default()).unwrap();
    let state = optim::TrainOptimizer::state(&opt).unwrap();
    assert_eq!(state["stats.0"].dtype(), DType::F32);
}

/// The state of an R x C weight is R + C numbers (AdamW: 2 R C).
#[test]
fn the_state_is_factored() {
    let w =
        Var::from_tensor(&Tensor::zeros((300, 200), DType::F32, &Device::Cpu).unwrap()).unwrap();
    let opt = Adafactor::new(vec![w], ParamsAdafactor::default()).unwrap();
    let state = optim::TrainOptimizer::state(&opt).unwrap();
    let numbers: usize =
        state.iter().filter(|(k, _)| *k != "step").map(|(_, t)| t.elem_count()).sum();
    assert_eq!(numbers, 300 + 200);
    assert_eq!(optim::TrainOptimizer::state_bytes(&opt), 4 * (300 + 200));
}
