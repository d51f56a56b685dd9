//! The SiLU-gated product of a gated MLP (Llama's, Qwen's): keeps its two operands, where the
//! composed product also keeps the activation between them. Not here: the projections around it
//! (the models' crates).

use crate::fused::dtype::widened;
use crate::fused::elem::Elem;
use crate::fused::generic::GenericOp;
use crate::fused::op::{exactly, FusedOp, Operand};
use crate::fused::parallel::ELEMENT_CHUNK;
use crate::fused::route::{fused, generic};
use crate::fused::storage::{shaped, slice, with_slice};
use crate::fused::uninit::uninit;
use candle_core::{CpuStorage, Result, Shape, Tensor};
use rayon::prelude::*;

/// `silu(gate) * up`, with silu(x) = x sigmoid(x), element by element (in the operands' dtype;
/// half precision in f32): Llama's `act_fn(gate_proj(x)) * up_proj(x)` as one op.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.shape() != up.shape() || gate.dtype() != up.dtype() {
        candle_core::bail!(
            "silu_mul: gate {:?} {:?} and up {:?} {:?} must match",
            gate.dims(),
            gate.dtype(),
            up.dims(),
            up.dtype()
        )
    }
    if generic(gate) {
        return silu_mul_generic(gate, up);
    }
    if !fused(gate) {
        return gate.silu()? * up;
    }
    gate.contiguous()?.apply_op2(&up.contiguous()?, SiluMulOp)
}

/// sigmoid(x) of a tensor, from candle's ops.
fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

/// The generic route ([`super::generic`]): the product composed on detached operands; backward
/// composed from the same derivatives as the kernel's.
fn silu_mul_generic(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let g32 = widened(&gate.detach())?;
    let y = ((&g32 * sigmoid(&g32)?)? * widened(&up.detach())?)?.to_dtype(gate.dtype())?;
    drop(g32);
    let backward = move |inputs: &[Tensor],
                         _: &Tensor,
                         g: &Tensor,
                         _want: &[bool]|
          -> Result<Vec<Option<Tensor>>> {
        let (x, u, g) = (widened(&inputs[0])?, widened(&inputs[1])?, widened(g)?);
        let s = sigmoid(&x)?;
        let silu = (&x * &s)?;
        // silu'(x) = s (1 + x (1 - s))
        let slope = ((&s * ((&x * s.affine(-1.0, 1.0)?)? + 1.0)?)? * &u)?;
        let dup = (&g * silu)?.to_dtype(inputs[1].dtype())?;
        let dgate = (g * slope)?.to_dtype(inputs[0].dtype())?;
        Ok(vec![Some(dgate), Some(dup)])
    };
    gate.contiguous()?
        .apply_op2(&up.contiguous()?, GenericOp::new("generic-silu-mul", y, Box::new(backward)))
}

struct SiluMulOp;

/// sigmoid(x) of a chunk, into `s`: exp(-x) many at once (`Elem::exp_in_place`), then 1 / (1 + e).
fn sigmoids<T: Elem>(x: &[T], s: &mut [T]) {
    s.iter_mut().zip(x).for_each(|(s, &x)| *s = -x);
    T::exp_in_place(s);
    s.iter_mut().for_each(|s| *s = T::one() / (T::one() + *s));
}

impl SiluMulOp {
    fn forward<T: Elem>(gate: &[T], up: &[T]) -> Vec<T> {
        // SAFETY: the loop below writes every element.
        let mut y = unsafe { uninit::<T>(gate.len()) };
        y.par_chunks_mut(ELEMENT_CHUNK).enumerate().for_each(|(c, y)| {
            let at = c * ELEMENT_CHUNK;
            let (gate, up) = (&gate[at..at + y.len()], &up[at..at + y.len()]);
            sigmoids(gate, y);
            for ((y, &x), &u) in y.iter_mut().zip(gate).zip(up) {
                *y = x * *y * u;
            }
        });
        y
    }

    /// d gate = g up silu'(gate), silu'(x) = s (1 + x (1 - s)); d up = g silu(gate) = g x s.
    fn backward<T: Elem>(gate: &[T], up: &[T], g: &[T]) -> (Vec<T>, Vec<T>) {
        // SAFETY: the loop below writes every element of both.
        let (mut dgate, mut dup) = unsafe { (uninit::<T>(gate.len()), uninit::<T>(gate.len())) };
        dgate
            .par_chunks_mut(ELEMENT_CHUNK)
            .zip(dup.par_chunks_mut(ELEMENT_CHUNK))
            .enumerate()
            .for_each(|(c, (dgate, dup))| {
                let at = c * ELEMENT_CHUNK;
                let n = dgate.len();
                let (gate, up, g) = (&gate[at..at + n], &up[at..at + n], &g[at..at + n]);
                // s into dup first, then each element's two gradients from it.
                sigmoids(gate, dup);
                for j in 0..n {
                    let (x, s) = (gate[j], dup[j]);
                    dgate[j] = g[j] * up[j] * (s * (T::one() + x * (T::one() - s)));
                    dup[j] = g[j] * (x * s);
                }
            });
        (dgate, dup)
    }
}

impl FusedOp for SiluMulOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let [(gate, gl), (up, ul)] = exactly(inputs)?;
        let y = per_float!(gate, "silu_mul", Self::forward(&slice(gate, gl)?, &slice(up, ul)?));
        Ok((y, gl.shape().clone()))
    }

    fn bwd(&self, inputs: &[&Tensor], _y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [gate, up] = exactly(inputs)?;
        let g = g.contiguous()?;
        let (dgate, dup) = per_dtype!(gate.dtype(), T => {
            let (dgate, dup) = with_slice::<T, _>(gate, |gs| {
                with_slice(up, |us| with_slice(&g, |ds| Ok(Self::backward(gs, us, ds))))
            })?;
            (shaped(dgate, gate)?, shaped(dup, up)?)
        });
        Ok(vec![Some(dgate), Some(dup)])
    }
}

custom_op!(SiluMulOp: 2 "fused-silu-mul");
