//! A frozen weight (a tensor no variable leads to) costs its backward no gradient: none is stored
//! for it and none is computed, in our fused ops on both paths and in candle's own ops; the trained
//! operands' gradients are the same bits as when the weight trains too. The control is the same
//! product with the weight trained, whose backward must peak at least a weight's gradient higher:
//! were frozen weights still given gradients, it would not. The counting allocator is process-wide,
//! and the fused path a process-wide setting: one test in this binary.

use candle_core::{Device, Result, Tensor, Var};
use ops::fused::{set_path, Path};
use ops::WeightLayout;
use remat::memory::peak_during;

#[global_allocator]
static ALLOC: remat::memory::CountingAlloc = remat::memory::CountingAlloc;

/// A product of a few rows by a large weight: the weight's gradient dwarfs every activation.
const ROWS: usize = 4;
const IN: usize = 1024;
const OUT: usize = 2048;

fn normal(name: &str, shape: &[usize]) -> Result<Tensor> {
    let n = shape.iter().product();
    Tensor::from_vec(remat::rng::RngKey::named(3, name).normal(n, 0.0, 0.5), shape, &Device::Cpu)
}

/// What one backward through `op(x, w)` did: its peak above the heap before it, the bytes of x
/// and of the output, whether `w` got a gradient, and the bits of `x`'s.
struct Backward {
    peak: u64,
    activation_bytes: u64,
    w_has_grad: bool,
    x_grad: Vec<u32>,
}

fn backward(
    op: &dyn Fn(&Tensor, &Tensor) -> Result<Tensor>,
    x: &Var,
    w: &Tensor,
) -> Result<Backward> {
    let y = op(x.as_tensor(), w)?;
    let activation_bytes = 4 * (x.elem_count() + y.elem_count()) as u64;
    let loss = y.sqr()?.sum_all()?;
    let (grads, peak) = peak_during(|| loss.backward());
    let grads = grads?;
    let x_grad = params::f32_bits(grads.get(x.as_tensor()).expect("x trains"))?;
    Ok(Backward { peak, activation_bytes, w_has_grad: grads.get(w).is_some(), x_grad })
}

/// `op` with its weight trained (the control) and frozen (the same storage, detached).
fn frozen_costs_nothing(
    what: &str,
    op: &dyn Fn(&Tensor, &Tensor) -> Result<Tensor>,
    x_shape: &[usize],
    w_shape: &[usize],
) -> Result<()> {
    let x = Var::from_tensor(&normal("x", x_shape)?)?;
    let w = Var::from_tensor(&normal("w", w_shape)?)?;
    let w_bytes = 4 * w.elem_count() as u64;
    let trained = backward(op, &x, w.as_tensor())?;
    let frozen = backward(op, &x, &w.as_tensor().detach())?;
    eprintln!(
        "{what}: backward peak {} B trained, {} B frozen (weight {w_bytes} B)",
        trained.peak, frozen.peak
    );
    assert!(
        trained.w_has_grad && trained.peak >= w_bytes,
        "{what}, control: the trained weight's gradient ({w_bytes} B) within a peak of {} B",
        trained.peak
    );
    assert!(!frozen.w_has_grad, "{what}: the frozen weight got a gradient");
    // The weight's gradient is saved (a convolution's input gradient still needs the kernel
    // transposed, a weight-sized copy, so the peak itself need not fall below it), less at most
    // the activations' gradients: the two peaks need not fall at the same moment of the backward.
    let saved = trained.peak.saturating_sub(frozen.peak);
    assert!(
        saved + trained.activation_bytes >= w_bytes,
        "{what}: frozen, the backward peaked only {saved} B lower; the weight's gradient is \
         {w_bytes} B"
    );
    assert!(
        trained.x_grad == frozen.x_grad,
        "{what}: the input's gradient changed with the weight frozen"
    );
    Ok(())
}

#[test]
fn a_frozen_weight_gets_no_gradient_computed_or_stored() -> Result<()> {
    let linear = |x: &Tensor, w: &Tensor| ops::fused::linear(x, w, None, WeightLayout::OutIn);
    let matmul = |x: &Tensor, w: &Tensor| x.matmul(&w.t()?);
    let conv = |x: &Tensor, w: &Tensor| ops::conv2d(x, w, 1, 1);
    let (rows, square) = ([ROWS, IN], [OUT, IN]);
    let (image, kernel) = ([1, 64, 4, 4], [1024, 64, 3, 3]);
    frozen_costs_nothing("fused linear", &linear, &rows, &square)?;
    frozen_costs_nothing("candle's matmul", &matmul, &rows, &square)?;
    frozen_costs_nothing("fused conv2d", &conv, &image, &kernel)?;
    set_path(Path::Generic);
    frozen_costs_nothing("generic linear", &linear, &rows, &square)?;
    frozen_costs_nothing("generic conv2d", &conv, &image, &kernel)?;
    set_path(Path::Kernel);
    Ok(())
}
