//! The kernel bench's side in this process: the convolutions a model runs, recorded from one
//! forward pass at its profile's sizes ([`convolutions`]), and each one timed on operands of its
//! shapes ([`time`]): the forward, and each backward alone (the input gradient, the weight
//! gradient), as a median over repetitions after a warm-up.
//!
//! The experiment's other layers: [`crate::run::kernels`] (the command: the rounds, PyTorch's
//! side) and [`crate::report::kernels`] (the report and its files).

use crate::report::kernels::ConvTimes;
use crate::report::record::Spread;
use crate::workloads::Workload;
use anyhow::Result;
use candle_core::{Device, Tensor, Var};
use ops::ConvCall;
use remat::rng::RngKey;
use std::time::Instant;

/// The convolutions a forward pass of `w` runs, in order.
pub fn convolutions(w: &Workload, device: &Device, seed: u64) -> Result<Vec<ConvCall>> {
    let inst = w.build(device, seed)?;
    let inputs = inst.inputs(0)?;
    let (loss, calls) = ops::record_convolutions(|| inst.graph().plain_loss(&inputs, seed, 0));
    loss?;
    Ok(calls)
}

/// Times `call` on `device`: each part `reps` times after two warm-ups, the median.
pub fn time(call: &ConvCall, device: &Device, reps: usize) -> Result<ConvTimes> {
    let data = call.data_operands();
    let operands: Vec<Tensor> = call
        .shapes
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let values =
                RngKey::named(7, &format!("operand {i}")).normal(shape.iter().product(), 0.0, 1.0);
            Ok(Tensor::from_vec(values, shape.as_slice(), device)?.to_dtype(call.dtype)?)
        })
        .collect::<Result<_>>()?;
    // The operands with the data (`true`) or the weights as variables: a backward then computes
    // that gradient alone.
    let with_vars = |data_vars: bool| -> Result<Vec<Tensor>> {
        operands
            .iter()
            .enumerate()
            .map(|(i, t)| match (i < data) == data_vars {
                true => Ok(Var::from_tensor(t)?.as_tensor().clone()),
                false => Ok(t.clone()),
            })
            .collect()
    };
    let forward_ms = median_ms(reps, || Ok(()), |()| call.call(&operands))?;
    // From a gradient of the output's shape, as a stage's backward hands it on (a `sum` as the
    // loss would time candle materialising its broadcast gradient, slower than the convolution),
    // a fresh copy each time as a model's backward hands on its own: one shared with the caller
    // is copied again when the backward stores it (an 8 MiB copy in a timed 1x1 convolution).
    let backward_ms = |data_vars: bool| -> Result<f64> {
        let y = call.call(&with_vars(data_vars)?)?;
        let values = RngKey::named(7, "output gradient").normal(y.elem_count(), 0.0, 1.0);
        let grad = Tensor::from_vec(values, y.shape(), device)?.to_dtype(y.dtype())?;
        median_ms(reps, || Ok(grad.copy()?), |g| remat::exec::seed(&y, g)?.backward())
    };
    let input_grad_ms = match call.needs_input_gradient() {
        true => Some(backward_ms(true)?),
        false => None,
    };
    Ok(ConvTimes { forward_ms, input_grad_ms, weight_grad_ms: backward_ms(false)? })
}

/// The median of `reps` runs of `f` in milliseconds, each on what `setup` makes for it (not
/// timed), after two runs not counted.
fn median_ms<S, T>(
    reps: usize,
    mut setup: impl FnMut() -> Result<S>,
    mut f: impl FnMut(S) -> candle_core::Result<T>,
) -> Result<f64> {
    for _ in 0..2 {
        f(setup()?)?;
    }
    let mut ms = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let operands = setup()?;
        let start = Instant::now();
        f(operands)?;
        ms.push(start.elapsed().as_secs_f64() * 1e3);
    }
    Ok(Spread::of(ms).map_or(f64::NAN, |s| s.median))
}
