//! BatchNorm in training mode, optionally with the residual and ReLU that follow it: keeps its
//! input and output (a composed BatchNorm + ReLU keeps 7 tensors of that size). A downsampling
//! residual block's end, two BatchNorms added and a ReLU, is one op too: it keeps both inputs and
//! the output, never the projection's normalised tensor. The CPU kernel is the `kernel` module,
//! the device-generic route the `generic` module; here, what a caller calls ([`Activation`] says
//! what follows the normalisation). Not here: the running statistics (the `BatchNorm` layer).

mod generic;
mod kernel;

pub(crate) use generic::{normalise, normalise_backward};

use crate::fused::dtype::operand;
use crate::fused::route::generic;
use candle_core::{Result, Tensor};
use generic::{batch_norm_generic, batch_norm_pair_generic};
pub(crate) use kernel::BatchNormOp;
use kernel::BatchNormPairOp;

/// BatchNorm of x (N, C, *spatial) with the batch's statistics, as PyTorch's training mode:
/// `(x - mean_c) / sqrt(var_c + eps) * weight_c + bias_c` with the biased variance, then
/// `+ residual` if given (same shape as x), then `activation` (a ReLU: a ResNet block's end,
/// `relu(bn(conv(h)) + identity)` as one op, which keeps only x and the output where the composed
/// version keeps the normalised tensor and the sum as well). Returns the output and the batch's
/// per-channel mean and biased variance, each (C) (for the running statistics). For float tensors
/// that take the kernel or the generic route: check `lean` (`fused::route`) first.
pub fn batch_norm_train(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    residual: Option<&Tensor>,
    eps: f64,
    activation: Activation,
) -> Result<(Tensor, Tensor, Tensor)> {
    if let Some(r) = residual.filter(|r| r.shape() != x.shape()) {
        candle_core::bail!(
            "batch_norm: residual {:?} does not match the input {:?}",
            r.dims(),
            x.dims()
        )
    }
    if generic(x) {
        return batch_norm_generic(x, weight, bias, residual, eps, activation);
    }
    let x = x.contiguous()?;
    let (op, stats) = BatchNormOp::of(&x, eps, activation)?;
    // Weight and bias travel as one (2, C) operand so that the residual fits a three-input op.
    let wb = operand(&Tensor::stack(&[weight, bias], 0)?, &x)?;
    let y = match residual {
        Some(r) => x.apply_op3(&wb, &r.to_dtype(x.dtype())?.contiguous()?, op)?,
        None => x.apply_op2(&wb, op)?,
    };
    Ok((y, stats.0, stats.1))
}

/// What follows the normalisation (and the residual) inside a BatchNorm op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// Nothing: the normalised input (plus any residual) is the output.
    Identity,
    /// A ReLU that lets a NaN through, as PyTorch's (a ResNet block's end).
    Relu,
}

/// A BatchNorm's input, weight and bias.
pub type Normalised<'a> = (&'a Tensor, &'a Tensor, &'a Tensor);

/// `relu(bn(x) + bn'(x'))` in training mode, for `a` = (x, weight, bias) and `b` = (x', weight',
/// bias') of one shape (a downsampling residual block's end: its last BatchNorm and the
/// projection's). One op, keeping x, x' and the output: composed of [`batch_norm_train`] with a
/// residual, the projection's normalised tensor would be kept as the residual operand (PyTorch
/// keeps none either). The same bits as that composition. Returns the output and each one's
/// per-channel batch mean and biased variance.
pub fn batch_norm_pair_train(
    a: Normalised,
    b: Normalised,
    eps: f64,
) -> Result<(Tensor, [(Tensor, Tensor); 2])> {
    if a.0.shape() != b.0.shape() {
        candle_core::bail!("batch_norm_pair: inputs {:?} and {:?} differ", a.0.dims(), b.0.dims())
    }
    if generic(a.0) {
        return batch_norm_pair_generic(a, b, eps);
    }
    let (xa, xb) = (a.0.contiguous()?, b.0.to_dtype(a.0.dtype())?.contiguous()?);
    let ((first, stats_a), (second, stats_b)) = (
        BatchNormOp::of(&xa, eps, Activation::Relu)?,
        BatchNormOp::of(&xb, eps, Activation::Identity)?,
    );
    let wb = operand(&Tensor::stack(&[a.1, a.2, b.1, b.2], 0)?, &xa)?; // (4, C)
    let y = xa.apply_op3(&xb, &wb, BatchNormPairOp { first, second })?;
    Ok((y, [stats_a, stats_b]))
}
