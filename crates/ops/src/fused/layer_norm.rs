//! LayerNorm: keeps nothing but its input (the statistics are recomputed in backward).

use crate::fused::dtype::{operand, widened, widened_as};
use crate::fused::elem::{elem, Elem};
use crate::fused::generic::GenericOp;
use crate::fused::op::{exactly, FusedOp, Operand};
use crate::fused::parallel::sum_rows;
use crate::fused::route::{fused, generic};
use crate::fused::storage::{shaped, slice, with_slice};
use crate::fused::uninit::uninit;
use candle_core::{CpuStorage, Result, Shape, Tensor, D};
use rayon::prelude::*;

/// Layer normalisation over the last dimension: `(x - mean) / sqrt(var + eps) * weight + bias`,
/// with the biased variance, as PyTorch's `layer_norm`.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    if generic(x) {
        return layer_norm_generic(x, weight, bias, eps);
    }
    if !fused(x) {
        return candle_nn::ops::layer_norm_slow(x, weight, bias, eps as f32);
    }
    let d = x.dim(D::Minus1)?;
    if weight.dims() != [d] || bias.dims() != [d] {
        candle_core::bail!(
            "layer_norm: weight {:?} and bias {:?} must be [{d}]",
            weight.dims(),
            bias.dims()
        )
    }
    x.contiguous()?.apply_op3(&operand(weight, x)?, &operand(bias, x)?, LayerNormOp { eps })
}

/// The generic route ([`super::generic`]): candle's composed LayerNorm on detached operands, and
/// the kernel's backward formula composed, the statistics recomputed from the input.
fn layer_norm_generic(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    // In f32 for half precision, stored in x's dtype, as the kernel.
    let x32 = widened(&x.detach())?;
    let y = candle_nn::ops::layer_norm_slow(
        &x32,
        &widened_as(&weight.detach(), x)?,
        &widened_as(&bias.detach(), x)?,
        eps as f32,
    )?
    .to_dtype(x.dtype())?;
    drop(x32);
    let backward = move |inputs: &[Tensor],
                         _y: &Tensor,
                         g: &Tensor,
                         _want: &[bool]|
          -> Result<Vec<Option<Tensor>>> {
        let [x, w, b] = exactly(&inputs.iter().collect::<Vec<_>>())?;
        let (x32, g32) = (widened(x)?, widened(g)?);
        let w32 = widened_as(w, x)?;
        let d = x.dim(D::Minus1)?;
        let rows = x.elem_count() / d;
        // Each temporary of the input's size goes once used: at most three are alive at once.
        let xc = x32.broadcast_sub(&x32.mean_keepdim(D::Minus1)?)?;
        let rstd = (xc.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
        let xhat = xc.broadcast_mul(&rstd)?;
        drop(xc);
        let dw = (&g32 * &xhat)?.reshape((rows, d))?.sum(0)?;
        let db = g32.reshape((rows, d))?.sum(0)?;
        let gw = g32.broadcast_mul(&w32)?;
        let (m1, m2) = (gw.mean_keepdim(D::Minus1)?, (&gw * &xhat)?.mean_keepdim(D::Minus1)?);
        let centred = gw.broadcast_sub(&m1)?;
        drop(gw);
        let dx = (centred - xhat.broadcast_mul(&m2)?)?;
        drop(xhat);
        let dx = dx.broadcast_mul(&rstd)?;
        Ok(vec![
            Some(dx.to_dtype(x.dtype())?),
            Some(dw.to_dtype(w.dtype())?),
            Some(db.to_dtype(b.dtype())?),
        ])
    };
    x.contiguous()?.apply_op3(
        weight,
        bias,
        GenericOp::new("generic-layer-norm", y, Box::new(backward)),
    )
}

struct LayerNormOp {
    eps: f64,
}

/// Mean and 1/sqrt(var + eps) of one row (two passes: the mean, then the centred squares).
fn row_stats<T: Elem>(row: &[T], eps: f64) -> (T, T) {
    let n = elem::<T>(row.len() as f64);
    let mean = row.iter().copied().sum::<T>() / n;
    let var = row.iter().map(|&v| (v - mean) * (v - mean)).sum::<T>() / n;
    (mean, T::one() / (var + elem(eps)).sqrt())
}

impl LayerNormOp {
    fn forward<T: Elem>(&self, x: &[T], w: &[T], b: &[T]) -> Vec<T> {
        // SAFETY: the loop below writes every element.
        let mut y = unsafe { uninit::<T>(x.len()) };
        y.par_chunks_mut(w.len()).zip(x.par_chunks(w.len())).for_each(|(y, x)| {
            let (mean, rstd) = row_stats(x, self.eps);
            for j in 0..x.len() {
                y[j] = (x[j] - mean) * rstd * w[j] + b[j];
            }
        });
        y
    }

    /// dx = rstd (g w - mean(g w) - x_hat mean(g w x_hat)); dw = sum over rows of g x_hat; db =
    /// sum over rows of g.
    fn backward<T: Elem>(&self, x: &[T], w: &[T], g: &[T]) -> (Vec<T>, Vec<T>, Vec<T>) {
        let d = w.len();
        // SAFETY: the loop below writes every element.
        let mut dx = unsafe { uninit::<T>(x.len()) };
        dx.par_chunks_mut(d).zip(x.par_chunks(d).zip(g.par_chunks(d))).for_each(|(dx, (x, g))| {
            let (mean, rstd) = row_stats(x, self.eps);
            let n = elem::<T>(d as f64);
            let (mut m1, mut m2) = (T::zero(), T::zero());
            for j in 0..d {
                let gw = g[j] * w[j];
                m1 += gw;
                m2 += gw * (x[j] - mean) * rstd;
            }
            let (m1, m2) = (m1 / n, m2 / n);
            for j in 0..d {
                dx[j] = rstd * (g[j] * w[j] - m1 - (x[j] - mean) * rstd * m2);
            }
        });
        let sums = sum_rows::<T>(x.len() / d, 2 * d, |i, acc| {
            let (x, g) = (&x[i * d..(i + 1) * d], &g[i * d..(i + 1) * d]);
            let (mean, rstd) = row_stats(x, self.eps);
            for j in 0..d {
                acc[j] += g[j] * (x[j] - mean) * rstd;
                acc[d + j] += g[j];
            }
        });
        (dx, sums[..d].to_vec(), sums[d..].to_vec())
    }
}

impl FusedOp for LayerNormOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let [(x, xl), (w, wl), (b, bl)] = exactly(inputs)?;
        let y = per_float!(
            x,
            "layer_norm",
            self.forward(&slice(x, xl)?, &slice(w, wl)?, &slice(b, bl)?)
        );
        Ok((y, xl.shape().clone()))
    }

    fn bwd(&self, inputs: &[&Tensor], _y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [x, w, _b] = exactly(inputs)?;
        let g = g.contiguous()?;
        let (dx, dw, db) = per_dtype!(x.dtype(), T => {
            let (dx, dw, db) = with_slice::<T, _>(x, |xs| {
                with_slice(w, |ws| with_slice(&g, |gs| Ok(self.backward(xs, ws, gs))))
            })?;
            (shaped(dx, x)?, shaped(dw, w)?, shaped(db, w)?)
        });
        Ok(vec![Some(dx), Some(dw), Some(db)])
    }
}

custom_op!(LayerNormOp: 3 "fused-layer-norm");
