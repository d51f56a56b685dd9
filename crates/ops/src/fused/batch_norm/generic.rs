//! BatchNorm's device-generic route (the `fused::generic` module): the statistics and the output
//! composed from candle's ops on detached operands, in f32 (f64 for f64), and the kernel's
//! backward formula composed, the statistics recomputed from the input. Keeps what the kernel
//! keeps. Not here: the CPU kernel (`kernel`), the running statistics (the `BatchNorm` layer).

use super::{Activation, Normalised};
use crate::fused::dtype::{widened, widened_as};
use crate::fused::generic::GenericOp;
use candle_core::{Result, Tensor};

/// The generic route ([`crate::fused::generic`]): the statistics and the output composed on
/// detached operands in f32 (f64 for f64), and the kernel's backward formula composed, the
/// statistics recomputed from the input. Keeps what the kernel keeps: x, (weight; bias), the
/// residual.
pub(super) fn batch_norm_generic(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    residual: Option<&Tensor>,
    eps: f64,
    activation: Activation,
) -> Result<(Tensor, Tensor, Tensor)> {
    let wb = Tensor::stack(&[weight, bias], 0)?; // (2, C): the op's operand, as on the kernel
    let residual_w = residual.map(|r| widened_as(&r.detach(), x)).transpose()?;
    let (y, mean, var) =
        normalise(x, &widened_as(&wb.detach(), x)?, residual_w.as_ref(), eps, activation)?;
    let backward = move |inputs: &[Tensor],
                         y: &Tensor,
                         g: &Tensor,
                         _want: &[bool]|
          -> Result<Vec<Option<Tensor>>> {
        let (x, wb) = (&inputs[0], &inputs[1]);
        let (dx, dwb, masked) =
            normalise_backward(x, &widened_as(wb, x)?, y, &widened_as(g, x)?, eps, activation)?;
        let dr = if inputs.len() == 3 { Some(masked.to_dtype(inputs[2].dtype())?) } else { None };
        Ok([Some(dx.to_dtype(x.dtype())?), Some(dwb.to_dtype(wb.dtype())?), dr]
            .into_iter()
            .take(inputs.len())
            .collect())
    };
    let op = GenericOp::new(
        if residual.is_some() { "generic-batch-norm-add" } else { "generic-batch-norm" },
        y,
        Box::new(backward),
    );
    let y = match residual {
        Some(r) => x.contiguous()?.apply_op3(&wb, &r.contiguous()?, op)?,
        None => x.contiguous()?.apply_op2(&wb, op)?,
    };
    Ok((y, mean, var))
}

/// [`batch_norm_pair_train`](super::batch_norm_pair_train)'s generic route:
/// [`batch_norm_generic`]'s composition twice in one op, keeping what the kernel keeps: x, x' and
/// (weight; bias; weight'; bias').
pub(super) fn batch_norm_pair_generic(
    a: Normalised,
    b: Normalised,
    eps: f64,
) -> Result<(Tensor, [(Tensor, Tensor); 2])> {
    let wb = Tensor::stack(&[a.1, a.2, b.1, b.2], 0)?; // (4, C), as on the kernel
    let wb_w = widened_as(&wb.detach(), a.0)?;
    let (r, mean_b, var_b) =
        normalise(b.0, &wb_w.narrow(0, 2, 2)?, None, eps, Activation::Identity)?;
    let (y, mean_a, var_a) =
        normalise(a.0, &wb_w.narrow(0, 0, 2)?, Some(&widened_as(&r, a.0)?), eps, Activation::Relu)?;
    let backward = move |inputs: &[Tensor],
                         y: &Tensor,
                         g: &Tensor,
                         _want: &[bool]|
          -> Result<Vec<Option<Tensor>>> {
        let (xa, xb, wb) = (&inputs[0], &inputs[1], &inputs[2]);
        let wb_w = widened_as(wb, xa)?;
        let (dxa, dwb_a, masked) = normalise_backward(
            xa,
            &wb_w.narrow(0, 0, 2)?,
            y,
            &widened_as(g, xa)?,
            eps,
            Activation::Relu,
        )?;
        let (dxb, dwb_b, _) =
            normalise_backward(xb, &wb_w.narrow(0, 2, 2)?, y, &masked, eps, Activation::Identity)?;
        let dwb = Tensor::cat(&[dwb_a, dwb_b], 0)?.to_dtype(wb.dtype())?;
        Ok(vec![Some(dxa.to_dtype(xa.dtype())?), Some(dxb.to_dtype(xb.dtype())?), Some(dwb)])
    };
    let op = GenericOp::new("generic-batch-norm-pair", y, Box::new(backward));
    let y = a.0.contiguous()?.apply_op3(&b.0.contiguous()?, &wb, op)?;
    Ok((y, [(mean_a, var_a), (mean_b, var_b)]))
}

/// The generic route's forward on the detached x: `bn(x) (+ residual)`, then `activation`,
/// with `wb_w` (weight; bias) and the residual already in the compute dtype; the output in x's
/// dtype, and the per-channel mean and biased variance (C).
pub(crate) fn normalise(
    x: &Tensor,
    wb_w: &Tensor,
    residual_w: Option<&Tensor>,
    eps: f64,
    activation: Activation,
) -> Result<(Tensor, Tensor, Tensor)> {
    let xw = widened(&x.detach())?;
    let (mean, var) = statistics(&xw)?;
    let rstd = (&var + eps)?.sqrt()?.recip()?;
    let (w, b) =
        (channel_shaped(&wb_w.get(0)?, x.rank())?, channel_shaped(&wb_w.get(1)?, x.rank())?);
    let mut y =
        xw.broadcast_sub(&mean)?.broadcast_mul(&(rstd.broadcast_mul(&w))?)?.broadcast_add(&b)?;
    if let Some(r) = residual_w {
        y = (y + r)?;
    }
    if activation == Activation::Relu {
        y = nan_relu(&y)?;
    }
    Ok((y.to_dtype(x.dtype())?, mean.flatten_all()?, var.flatten_all()?))
}

/// The kernel's backward formula composed, for the output y and its gradient g (in the compute
/// dtype): dx (compute dtype), d(weight; bias) (2, C), and g masked by the ReLU (the residual's
/// gradient).
pub(crate) fn normalise_backward(
    x: &Tensor,
    wb_w: &Tensor,
    y: &Tensor,
    g: &Tensor,
    eps: f64,
    activation: Activation,
) -> Result<(Tensor, Tensor, Tensor)> {
    let xw = widened(x)?;
    // A NaN output passes its gradient, as in the kernel.
    let g = match activation {
        Activation::Relu => y.le(0.0)?.where_cond(&g.zeros_like()?, g)?,
        Activation::Identity => g.clone(),
    };
    let (mean, var) = statistics(&xw)?;
    let rstd = (var + eps)?.sqrt()?.recip()?;
    let x_hat = xw.broadcast_sub(&mean)?.broadcast_mul(&rstd)?;
    let db = channel_sum(&g)?;
    let dw = channel_sum(&(&g * &x_hat)?)?;
    let m = (x.elem_count() / x.dim(1)?) as f64;
    let w = channel_shaped(&wb_w.get(0)?, x.rank())?;
    let (db_m, dw_m) =
        (channel_shaped(&(&db / m)?, x.rank())?, channel_shaped(&(&dw / m)?, x.rank())?);
    let dx = g
        .broadcast_sub(&db_m)?
        .sub(&x_hat.broadcast_mul(&dw_m)?)?
        .broadcast_mul(&(rstd.broadcast_mul(&w))?)?;
    Ok((dx, Tensor::stack(&[dw, db], 0)?, g))
}

/// Per-channel mean and biased variance of x (N, C, *spatial), each shaped (1, C, 1, ...), two
/// passes as the kernel (the mean, then the centred squares).
fn statistics(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let reduce = batch_and_space(x.rank());
    let mean = x.mean_keepdim(reduce.as_slice())?;
    let var = x.broadcast_sub(&mean)?.sqr()?.mean_keepdim(reduce.as_slice())?;
    Ok((mean, var))
}

/// Every dimension of a (N, C, *spatial) tensor of rank `rank` but the channels.
fn batch_and_space(rank: usize) -> Vec<usize> {
    (0..rank).filter(|&d| d != 1).collect()
}

/// A (C) tensor as (1, C, 1, ...) of rank `rank`, to broadcast over batch and space.
fn channel_shaped(t: &Tensor, rank: usize) -> Result<Tensor> {
    let mut shape = vec![1; rank];
    shape[1] = t.elem_count();
    t.reshape(shape)
}

/// The sum over batch and space of x (N, C, *spatial): (C).
fn channel_sum(x: &Tensor) -> Result<Tensor> {
    x.sum(batch_and_space(x.rank()).as_slice())
}

/// ReLU that lets a NaN through, as the kernel and PyTorch (candle's `relu` makes it 0).
fn nan_relu(y: &Tensor) -> Result<Tensor> {
    let keep = y.gt(0.0)?.add(&y.ne(y)?)?; // 1 where y > 0 or y is NaN
    keep.where_cond(y, &y.zeros_like()?)
}
