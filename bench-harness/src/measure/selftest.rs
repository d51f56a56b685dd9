//! `bench-harness selftest`: a quick check of a device before a long run.
//!
//! It runs in this process alone, and prints its one line itself: no `run` or `report` module;
//! its gradient check is [`super::one`]'s.

use super::one;
use crate::workloads::{self, Profile};
use anyhow::{Context, Result};
use remat::Policy;

/// `selftest`: the device's tensor ops, conv2d and backward, the memory meter, and a bit-exact
/// gradient check of gpt2-tiny under `sqrt`; one JSON line, or the first problem as an error.
pub fn selftest(device: trainkit::DeviceName) -> Result<()> {
    let device_name = device.to_string();
    use candle_core::{DType, Tensor, Var};
    let dev = device.open()?;
    let counter = remat::memory::Counter::for_device(&dev);
    counter.reset_peak();
    let base = counter.current();
    let a = Tensor::arange(0f32, 64.0, &dev)?.reshape((8, 8))?;
    let matmul = a.matmul(&a.t()?)?.sum_all()?.to_scalar::<f32>()?;
    let expected: f32 = (0..8)
        .flat_map(|i| {
            (0..8).map(move |j| (0..8).map(|k| ((8 * i + k) * (8 * j + k)) as f32).sum::<f32>())
        })
        .sum();
    anyhow::ensure!(matmul == expected, "matmul gave {matmul}, expected {expected}");
    let x = Var::from_tensor(&Tensor::ones((1, 2, 6, 6), DType::F32, &dev)?)?;
    let w = Tensor::ones((3, 2, 3, 3), DType::F32, &dev)?;
    let y = x.as_tensor().conv2d(&w, 1, 2, 1, 1)?; // (1, 3, 3, 3)
    let grads = y.sum_all()?.backward()?;
    let g = grads
        .get(x.as_tensor())
        .context("conv2d backward gave no gradient")?
        .sum_all()?
        .to_scalar::<f32>()?;
    anyhow::ensure!(g > 0.0, "conv2d input gradient sums to {g}");
    counter.synchronize();
    let peak = counter.peak().saturating_sub(base);
    anyhow::ensure!(peak > 0, "the memory meter saw no allocation");
    let w = workloads::profile(Profile::Smoke)
        .into_iter()
        .find(|w| w.model == "gpt2-tiny")
        .context("gpt2-tiny in smoke")?;
    let group = trainkit::Group::single();
    let at = one::Setting {
        device: &dev,
        device_name: &device_name,
        seed: 0,
        steps: 1,
        cap: None,
        predict_step: true,
        profiles: None,
        group: &group,
    };
    let mut rec = one::run(&w, &Policy::Sqrt.into(), &at)?;
    one::check(&mut rec, &w, &Policy::Sqrt, 0, &dev, one::RecomputeRng::Replayed)?;
    anyhow::ensure!(
        rec.grads_bit_identical,
        "gpt2-tiny sqrt: {} gradient elements differ from plain candle",
        rec.grads_differing
    );
    let report = serde_json::json!({
        "device": device_name,
        "matmul": matmul,
        "conv2d_input_grad_sum": g,
        "meter_peak_bytes": peak,
        "reserved_bytes": counter.reserved(),
        "gpt2_tiny_sqrt_bit_identical": rec.grads_bit_identical,
    });
    trainkit::show!("{report}");
    Ok(())
}
