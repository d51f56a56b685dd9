//! Inverted dropout: keeps nothing, its backward draws the mask again from its key instead of
//! holding it; its bits equal `x * mask` composed.

use crate::fused::dtype::widened;
use crate::fused::elem::{elem, Elem};
use crate::fused::generic::GenericOp;
use crate::fused::op::{exactly, FusedOp, Operand};
use crate::fused::parallel::ELEMENT_CHUNK;
use crate::fused::route::{fused, generic};
use crate::fused::storage::{shaped, slice, with_slice};
use candle_core::{CpuStorage, Result, Shape, Tensor};
use rayon::prelude::*;
use remat::rng::{DropoutRule, RngKey};

/// Inverted dropout: `x * mask` with `mask = 1 / (1 - p)` where `key`'s uniform draw is below
/// `1 - p`, else 0 (remat's `DropoutRule`, the mask of `RngKey::dropout_mask`). Backward draws the
/// mask again from the key.
pub fn dropout(x: &Tensor, key: RngKey, p: f32) -> Result<Tensor> {
    let mask = move |like: &Tensor| key.dropout_mask_like(like, p);
    if generic(x) {
        // Nothing kept: backward draws the mask again from the key. In f32 for half precision (the
        // scale 1 / (1 - p) is not a bf16 number), stored in x's dtype, as the kernel.
        let masked = move |t: &Tensor| -> Result<Tensor> {
            let wide = widened(t)?;
            (&wide * mask(&wide)?)?.to_dtype(t.dtype())
        };
        let y = masked(&x.detach())?;
        let backward =
            move |_: &[Tensor], _: &Tensor, g: &Tensor, _: &[bool]| Ok(vec![Some(masked(g)?)]);
        return x.contiguous()?.apply_op1(GenericOp::new("generic-dropout", y, Box::new(backward)));
    }
    if !fused(x) {
        return x * mask(x)?;
    }
    x.contiguous()?.apply_op1(DropoutOp { key, p })
}

pub(super) struct DropoutOp {
    pub(super) key: RngKey,
    pub(super) p: f32,
}

impl DropoutOp {
    /// `x * mask`, element by element, the mask drawn in parallel pieces of the key's stream.
    fn masked<T: Elem>(&self, x: &[T]) -> Vec<T> {
        let mut y = x.to_vec();
        self.mask_in_place(&mut y);
        y
    }

    pub(super) fn mask_in_place<T: Elem>(&self, x: &mut [T]) {
        let rule = DropoutRule::new(self.p);
        let scale = elem::<T>(rule.scale() as f64);
        x.par_chunks_mut(ELEMENT_CHUNK).enumerate().for_each(|(c, x)| {
            let mut u = vec![0f32; x.len()];
            self.key.uniform_into(c * ELEMENT_CHUNK, &mut u);
            for (x, &u) in x.iter_mut().zip(&u) {
                *x *= rule.mask(u, scale, T::zero());
            }
        });
    }
}

impl FusedOp for DropoutOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let [(s, l)] = exactly(inputs)?;
        let y = per_float!(s, "dropout", self.masked(&slice(s, l)?));
        Ok((y, l.shape().clone()))
    }

    fn bwd(&self, inputs: &[&Tensor], _y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [x] = exactly(inputs)?;
        let g = g.contiguous()?;
        let dx = per_dtype!(x.dtype(), T => {
            shaped(with_slice::<T, _>(&g, |gs| Ok(self.masked(gs)))?, x)?
        });
        Ok(vec![Some(dx)])
    }
}

custom_op!(DropoutOp: 1 "fused-dropout");
