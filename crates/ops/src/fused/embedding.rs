//! Embedding: a row lookup that keeps only its ids; its backward builds the table's gradient in
//! one allocation.

use crate::fused::elem::Elem;
use crate::fused::generic::GenericOp;
use crate::fused::op::{exactly, FusedOp, Operand};
use crate::fused::route::{fused, generic};
use crate::fused::storage::{shaped, slice, with_slice};
use candle_core::{CpuStorage, DType, Result, Shape, Tensor};
use rayon::prelude::*;

/// Rows `ids` (u32, any shape) of the table w (V, C), as (ids.., C). Its backward builds the
/// table's gradient in one allocation (candle's `index_select` makes a zero table, then a second
/// one with the rows added), rows added in token order.
pub fn embedding(w: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let mut shape = ids.dims().to_vec();
    shape.push(w.dim(1)?);
    if generic(w) && ids.dtype() == DType::U32 {
        let ids = ids.flatten_all()?.contiguous()?;
        let y = w.detach().index_select(&ids, 0)?;
        // The table's gradient: each token's row added at its id.
        let backward = |inputs: &[Tensor],
                        _: &Tensor,
                        g: &Tensor,
                        _: &[bool]|
         -> Result<Vec<Option<Tensor>>> {
            let (w, ids) = (&inputs[0], &inputs[1]);
            Ok(vec![Some(w.zeros_like()?.index_add(ids, &g.to_dtype(w.dtype())?, 0)?), None])
        };
        return w
            .contiguous()?
            .apply_op2(&ids, GenericOp::new("generic-embedding", y, Box::new(backward)))?
            .reshape(shape);
    }
    if !fused(w) || ids.dtype() != DType::U32 {
        return w.index_select(&ids.flatten_all()?, 0)?.reshape(shape);
    }
    w.contiguous()?
        .apply_op2(
            &ids.flatten_all()?.contiguous()?,
            EmbeddingOp { vocab: w.dim(0)?, width: w.dim(1)? },
        )?
        .reshape(shape)
}

struct EmbeddingOp {
    vocab: usize,
    width: usize,
}

impl EmbeddingOp {
    fn check(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&i| i as usize >= self.vocab) {
            Some(bad) => candle_core::bail!(
                "embedding: id {bad} is outside the vocabulary of {}",
                self.vocab
            ),
            None => Ok(()),
        }
    }

    fn forward<T: Elem>(&self, w: &[T], ids: &[u32]) -> Vec<T> {
        let c = self.width;
        let mut y = vec![T::zero(); ids.len() * c];
        y.par_chunks_mut(c)
            .zip(ids.par_iter())
            .for_each(|(y, &i)| y.copy_from_slice(&w[i as usize * c..(i as usize + 1) * c]));
        y
    }

    fn backward<T: Elem>(&self, ids: &[u32], g: &[T]) -> Vec<T> {
        let c = self.width;
        let mut dw = vec![T::zero(); self.vocab * c];
        for (&i, g) in ids.iter().zip(g.chunks(c)) {
            dw[i as usize * c..(i as usize + 1) * c].iter_mut().zip(g).for_each(|(d, &g)| *d += g);
        }
        dw
    }
}

impl FusedOp for EmbeddingOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let [(w, wl), (ids, il)] = exactly(inputs)?;
        let ids = slice::<u32>(ids, il)?;
        self.check(&ids)?;
        let y = per_float!(w, "embedding", self.forward(&slice(w, wl)?, &ids));
        Ok((y, Shape::from((ids.len(), self.width))))
    }

    fn bwd(&self, inputs: &[&Tensor], _y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [w, ids] = exactly(inputs)?;
        let g = g.contiguous()?;
        let dw = per_dtype!(w.dtype(), T => {
            let dw = with_slice::<u32, _>(ids, |ids| {
                with_slice::<T, _>(&g, |gs| Ok(self.backward(ids, gs)))
            })?;
            shaped(dw, w)?
        });
        Ok(vec![Some(dw), None])
    }
}

custom_op!(EmbeddingOp: 2 "fused-embedding");
