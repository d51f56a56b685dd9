//! Softmax over the last dimension, with an optional scale and causal mask ([`Mask`]) folded in:
//! keeps only its output. Not here: the key padding mask, which only attention takes
//! (`attention`).

use crate::fused::dtype::widened;
use crate::fused::elem::{elem, Elem};
use crate::fused::generic::GenericOp;
use crate::fused::op::{exactly, FusedOp, Operand};
use crate::fused::parallel::{dot_lanes, max_lanes, sum_lanes};
use crate::fused::route::{fused, generic};
use crate::fused::storage::{shaped, slice, with_slice};
use crate::fused::uninit::uninit;
use candle_core::{CpuStorage, Result, Shape, Tensor, D};
use rayon::prelude::*;

/// Which entries of attention scores (.., query i, key j) a softmax over them masks out
/// (probability 0) by their place, beside any key padding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mask {
    /// None: every key is seen (an encoder's self-attention, or a softmax over anything else).
    None,
    /// The future: key j where j > i, as in a decoder's self-attention.
    Causal,
}

/// `softmax(scale * x)` over the last dimension; with [`Mask::Causal`], element (.., i, j) of the
/// last two dimensions is masked out (probability 0) where j > i, as in a decoder's
/// self-attention.
pub fn softmax_last_dim(x: &Tensor, scale: f64, mask: Mask) -> Result<Tensor> {
    if generic(x) {
        // The composed softmax on the detached input; backward from the output alone:
        // dx = scale y (g - sum(g y)) (masked entries have y = 0, so no gradient).
        let y = detached(&x.detach(), scale, mask)?;
        let backward = move |_: &[Tensor],
                             y: &Tensor,
                             g: &Tensor,
                             _: &[bool]|
              -> Result<Vec<Option<Tensor>>> {
            let (y32, g32) = (widened(y)?, widened(g)?);
            let gy = (&g32 * &y32)?;
            let row = gy.sum_keepdim(D::Minus1)?;
            let dx = (gy - y32.broadcast_mul(&row)?)?;
            Ok(vec![Some((dx * scale)?.to_dtype(y.dtype())?)])
        };
        return x.contiguous()?.apply_op1(GenericOp::new("generic-softmax", y, Box::new(backward)));
    }
    if !fused(x) {
        return composed(x, scale, mask);
    }
    let rows_per_block = match mask {
        Mask::Causal => x.dim(D::Minus2)?,
        Mask::None => 1,
    };
    x.contiguous()?.apply_op1(SoftmaxOp { scale, mask, rows_per_block, padding: None })
}

/// `softmax(scale * x)` from candle's ops (candle's fused softmax_last_dim has no backward).
fn composed(x: &Tensor, scale: f64, mask: Mask) -> Result<Tensor> {
    let x = (x * scale)?;
    let x = match mask {
        Mask::Causal => mask_future(&x)?,
        Mask::None => x,
    };
    candle_nn::ops::softmax(&x, D::Minus1)
}

/// `softmax(scale * x)` of a detached `x` through candle's fused softmax kernel (on every device;
/// it has no backward, which a detached input does not need), computed in f32 for half precision
/// and returned in `x`'s dtype: the generic route's forward. Each temporary goes once used.
pub(crate) fn detached(x: &Tensor, scale: f64, mask: Mask) -> Result<Tensor> {
    let mut scaled = (widened(x)? * scale)?;
    if mask == Mask::Causal {
        scaled = mask_future(&scaled)?;
    }
    candle_nn::ops::softmax_last_dim(&scaled)?.to_dtype(x.dtype())
}

/// `x` (.., T, S) with element (.., i, j) set to -inf where j > i: the future keys of a decoder.
fn mask_future(x: &Tensor) -> Result<Tensor> {
    let (t, s) = (x.dim(D::Minus2)?, x.dim(D::Minus1)?);
    let future = Tensor::from_vec(
        (0..t * s).map(|i| u8::from(i % s > i / s)).collect(),
        (t, s),
        x.device(),
    )?;
    let neg_inf =
        Tensor::new(f32::NEG_INFINITY, x.device())?.to_dtype(x.dtype())?.broadcast_as(x.shape())?;
    future.broadcast_as(x.shape())?.where_cond(&neg_inf, x)
}

pub(crate) struct SoftmaxOp {
    pub(crate) scale: f64,
    pub(crate) mask: Mask,
    /// With [`Mask::Causal`], the number of rows of each (T, S) attention map: row r is query r %
    /// T.
    pub(crate) rows_per_block: usize,
    /// Key padding: which of each batch element's S keys may be attended to, (B, S) flat, and
    /// the rows per batch element (heads x T). A row with no key left is all zeros.
    pub(crate) padding: Option<(std::sync::Arc<Vec<bool>>, usize)>,
}

impl SoftmaxOp {
    /// How many leading entries of row `r` are visible.
    fn visible(&self, r: usize, width: usize) -> usize {
        match self.mask {
            Mask::Causal => (r % self.rows_per_block + 1).min(width),
            Mask::None => width,
        }
    }

    /// Which of row `r`'s keys are not padding (each of its `width`), where there is padding.
    fn keys(&self, r: usize, width: usize) -> Option<&[bool]> {
        self.padding.as_ref().map(|(keep, rows)| &keep[r / rows * width..(r / rows + 1) * width])
    }

    pub(crate) fn forward<T: Elem>(&self, x: &[T], width: usize) -> Vec<T> {
        let scale = elem::<T>(self.scale);
        // SAFETY: each row below writes every element of its row of y.
        let mut y = unsafe { uninit::<T>(x.len()) };
        y.par_chunks_mut(width).zip(x.par_chunks(width)).enumerate().for_each(|(r, (y, x))| {
            let n = self.visible(r, width);
            let (y, hidden) = y.split_at_mut(n);
            hidden.fill(T::zero());
            y.iter_mut().zip(x).for_each(|(y, &x)| *y = x * scale);
            if let Some(keys) = self.keys(r, width) {
                y.iter_mut()
                    .zip(keys)
                    .filter(|(_, &k)| !k)
                    .for_each(|(y, _)| *y = T::neg_infinity());
            }
            let max = max_lanes(y);
            if max == T::neg_infinity() {
                y.fill(T::zero()); // every key masked: the row is zero
                return;
            }
            // A masked entry, -inf, gets exp(-inf) = 0.
            y.iter_mut().for_each(|v| *v -= max);
            T::exp_in_place(y);
            let sum = sum_lanes(y);
            y.iter_mut().for_each(|v| *v /= sum);
        });
        y
    }

    /// dx = scale * y * (g - sum(g y)) per row; 0 where masked (there y = 0, and g may be
    /// anything).
    pub(crate) fn backward<T: Elem>(&self, y: &[T], g: &[T], width: usize) -> Vec<T> {
        let scale = elem::<T>(self.scale);
        // SAFETY: each row below writes every element of its row of dx.
        let mut dx = unsafe { uninit::<T>(y.len()) };
        dx.par_chunks_mut(width)
            .zip(y.par_chunks(width).zip(g.par_chunks(width)))
            .enumerate()
            .for_each(|(r, (dx, (y, g)))| {
                let n = self.visible(r, width);
                let (dx, hidden) = dx.split_at_mut(n);
                hidden.fill(T::zero());
                let (y, g) = (&y[..n], &g[..n]);
                match self.keys(r, width) {
                    None => {
                        let dot = dot_lanes(g, y);
                        for ((dx, &y), &g) in dx.iter_mut().zip(y).zip(g) {
                            *dx = scale * y * (g - dot);
                        }
                    }
                    Some(keys) => {
                        let kept = |j: usize| keys[j];
                        let dot = (0..n).filter(|&j| kept(j)).map(|j| g[j] * y[j]).sum::<T>();
                        for (j, dx) in dx.iter_mut().enumerate() {
                            *dx = if kept(j) { scale * y[j] * (g[j] - dot) } else { T::zero() };
                        }
                    }
                }
            });
        dx
    }
}

impl FusedOp for SoftmaxOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let [(s, l)] = exactly(inputs)?;
        let width = l.dims().last().copied().unwrap_or(1);
        let y = per_float!(s, "softmax", self.forward(&slice(s, l)?, width));
        Ok((y, l.shape().clone()))
    }

    fn bwd(&self, _inputs: &[&Tensor], y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let (g, width) = (g.contiguous()?, y.dim(D::Minus1)?);
        let dx = per_dtype!(y.dtype(), T => {
            let dx =
                with_slice::<T, _>(y, |ys| with_slice(&g, |gs| Ok(self.backward(ys, gs, width))))?;
            shaped(dx, y)?
        });
        Ok(vec![Some(dx)])
    }
}

custom_op!(SoftmaxOp: 1 "fused-softmax");
