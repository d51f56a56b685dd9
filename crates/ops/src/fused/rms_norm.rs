//! RMSNorm: keeps nothing but its input (the scale is recomputed in backward), where the composed
//! norm keeps its input, the normalised input and the scale. Not here: the layer that holds the
//! weight (`layers::norm`).

use crate::fused::dtype::{operand, widened, widened_as};
use crate::fused::elem::{elem, Elem};
use crate::fused::generic::GenericOp;
use crate::fused::op::{exactly, FusedOp, Operand};
use crate::fused::parallel::sum_rows;
use crate::fused::route::{fused, generic};
use crate::fused::storage::{shaped, slice, with_slice};
use crate::fused::uninit::uninit;
use candle_core::{CpuStorage, DType, Result, Shape, Tensor, D};
use rayon::prelude::*;

/// Root-mean-square normalisation over the last dimension, `x / sqrt(mean(x^2) + eps) * weight`,
/// as Llama's `LlamaRMSNorm` (in f32 for half precision, stored in x's dtype).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    if weight.dims() != [d] {
        candle_core::bail!("rms_norm: weight {:?} must be [{d}]", weight.dims())
    }
    if generic(x) {
        return rms_norm_generic(x, weight, eps);
    }
    if !fused(x) {
        return composed(x, weight, eps);
    }
    x.contiguous()?.apply_op2(&operand(weight, x)?, RmsNormOp { eps })
}

/// `1 / sqrt(mean(x^2) + eps)` per row of x (.., 1), and x / that scale.
fn scaled(x: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let rstd = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    Ok((x.broadcast_mul(&rstd)?, rstd))
}

/// Candle's ops where no lean route applies (Metal, integer tensors), in f32 as the kernel.
fn composed(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let x32 = x.to_dtype(DType::F32)?;
    let (xhat, _) = scaled(&x32, eps)?;
    xhat.broadcast_mul(&weight.to_dtype(DType::F32)?)?.to_dtype(x.dtype())
}

/// The generic route ([`super::generic`]): the norm composed on detached operands, its backward
/// composed from the kernel's formula, the scale recomputed from the input.
fn rms_norm_generic(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let (x32, w32) = (widened(&x.detach())?, widened_as(&weight.detach(), x)?);
    let y = scaled(&x32, eps)?.0.broadcast_mul(&w32)?.to_dtype(x.dtype())?;
    drop(x32);
    let backward = move |inputs: &[Tensor],
                         _y: &Tensor,
                         g: &Tensor,
                         _want: &[bool]|
          -> Result<Vec<Option<Tensor>>> {
        let [x, w] = exactly(&inputs.iter().collect::<Vec<_>>())?;
        let (g32, w32) = (widened(g)?, widened_as(w, x)?);
        let d = x.dim(D::Minus1)?;
        let (xhat, rstd) = scaled(&widened(x)?, eps)?;
        let dw = (&g32 * &xhat)?.reshape((x.elem_count() / d, d))?.sum(0)?;
        let gw = g32.broadcast_mul(&w32)?;
        let m = (&gw * &xhat)?.mean_keepdim(D::Minus1)?;
        let dx = (gw - xhat.broadcast_mul(&m)?)?.broadcast_mul(&rstd)?;
        Ok(vec![Some(dx.to_dtype(x.dtype())?), Some(dw.to_dtype(w.dtype())?)])
    };
    x.contiguous()?.apply_op2(weight, GenericOp::new("generic-rms-norm", y, Box::new(backward)))
}

struct RmsNormOp {
    eps: f64,
}

/// 1 / sqrt(mean(x^2) + eps) of one row.
fn rstd<T: Elem>(row: &[T], eps: f64) -> T {
    let mean = row.iter().map(|&v| v * v).sum::<T>() / elem(row.len() as f64);
    T::one() / (mean + elem(eps)).sqrt()
}

impl RmsNormOp {
    fn forward<T: Elem>(&self, x: &[T], w: &[T]) -> Vec<T> {
        // SAFETY: the loop below writes every element.
        let mut y = unsafe { uninit::<T>(x.len()) };
        y.par_chunks_mut(w.len()).zip(x.par_chunks(w.len())).for_each(|(y, x)| {
            let r = rstd(x, self.eps);
            for j in 0..x.len() {
                y[j] = x[j] * r * w[j];
            }
        });
        y
    }

    /// With x_hat = x rstd: dx = rstd (g w - x_hat mean(g w x_hat)); dw = sum over rows of
    /// g x_hat.
    fn backward<T: Elem>(&self, x: &[T], w: &[T], g: &[T]) -> (Vec<T>, Vec<T>) {
        let d = w.len();
        // SAFETY: the loop below writes every element.
        let mut dx = unsafe { uninit::<T>(x.len()) };
        dx.par_chunks_mut(d).zip(x.par_chunks(d).zip(g.par_chunks(d))).for_each(|(dx, (x, g))| {
            let r = rstd(x, self.eps);
            let m = (0..d).map(|j| g[j] * w[j] * x[j] * r).sum::<T>() / elem(d as f64);
            for j in 0..d {
                dx[j] = r * (g[j] * w[j] - x[j] * r * m);
            }
        });
        let dw = sum_rows::<T>(x.len() / d, d, |i, acc| {
            let (x, g) = (&x[i * d..(i + 1) * d], &g[i * d..(i + 1) * d]);
            let r = rstd(x, self.eps);
            for j in 0..d {
                acc[j] += g[j] * x[j] * r;
            }
        });
        (dx, dw)
    }
}

impl FusedOp for RmsNormOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let [(x, xl), (w, wl)] = exactly(inputs)?;
        let y = per_float!(x, "rms_norm", self.forward(&slice(x, xl)?, &slice(w, wl)?));
        Ok((y, xl.shape().clone()))
    }

    fn bwd(&self, inputs: &[&Tensor], _y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [x, w] = exactly(inputs)?;
        let g = g.contiguous()?;
        let (dx, dw) = per_dtype!(x.dtype(), T => {
            let (dx, dw) = with_slice::<T, _>(x, |xs| {
                with_slice(w, |ws| with_slice(&g, |gs| Ok(self.backward(xs, ws, gs))))
            })?;
            (shaped(dx, x)?, shaped(dw, w)?)
        });
        Ok(vec![Some(dx), Some(dw)])
    }
}

custom_op!(RmsNormOp: 2 "fused-rms-norm");
