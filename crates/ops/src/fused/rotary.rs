//! Rotary position embeddings (RoFormer; Llama's `apply_rotary_pos_emb`), applied inside
//! attention to q and k: each pair of features (i, i + d/2) of a head at position p turned by the
//! angle p * inv_freq[i]. A rotation needs nothing of its input to be undone, so attention keeps
//! q and k as they came and turns them again in backward, then turns their gradients back: no
//! rotated copy and no cos/sin per call beyond one table of the op's positions. Not here: the
//! frequencies (the model's configuration), attention itself (`attention`).

use crate::fused::elem::Elem;
use crate::fused::uninit::uninit;
use candle_core::{Result, Tensor, D};
use rayon::prelude::*;
use std::sync::Arc;

/// The rotary embedding of heads of `2 * inv_freq.len()` features.
#[derive(Clone, Debug)]
pub struct Rotary {
    inv_freq: Arc<Vec<f32>>,
}

/// Which way a rotation turns: by the angle (the forward), or back by it (the gradient's way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Turn {
    Forward,
    Back,
}

impl Rotary {
    /// From the inverse frequencies of the feature pairs, one per pair (head_dim / 2).
    pub fn new(inv_freq: Vec<f32>) -> Self {
        Rotary { inv_freq: Arc::new(inv_freq) }
    }

    pub fn head_dim(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// The cosines and sines of positions 0..`positions`, in f32 as transformers computes them
    /// (`inv_freq * position`, then cos and sin).
    pub(crate) fn table(&self, positions: usize) -> Table {
        let half = self.inv_freq.len();
        let angles: Vec<f32> =
            (0..positions).flat_map(|p| self.inv_freq.iter().map(move |&f| f * p as f32)).collect();
        Table {
            half,
            cos: angles.iter().map(|a| a.cos()).collect(),
            sin: angles.iter().map(|a| a.sin()).collect(),
        }
    }
}

/// cos and sin of every position's angles, (positions, d/2) each.
pub(crate) struct Table {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Table {
    fn positions(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Rows of `x` (each one head's d = 2 half features) turned, row i at position i % `period`:
    /// (x1 cos - x2 sin, x2 cos + x1 sin) forward, (x1 cos + x2 sin, x2 cos - x1 sin) back.
    pub(crate) fn rotate<T: Elem>(&self, x: &[T], period: usize, turn: Turn) -> Result<Vec<T>> {
        let (half, d) = (self.half, 2 * self.half);
        self.check(x.len(), d, period)?;
        let sign = T::from(if turn == Turn::Forward { 1.0 } else { -1.0 }).expect("a sign");
        // SAFETY: the loop below writes every element.
        let mut y = unsafe { uninit::<T>(x.len()) };
        y.par_chunks_mut(d).zip(x.par_chunks(d)).enumerate().for_each(|(i, (y, x))| {
            let at = (i % period) * half;
            for j in 0..half {
                let (c, s) = (T::from(self.cos[at + j]), T::from(self.sin[at + j]));
                let (c, s) = (c.expect("f32 widens"), s.expect("f32 widens") * sign);
                y[j] = x[j] * c - x[j + half] * s;
                y[j + half] = x[j + half] * c + x[j] * s;
            }
        });
        Ok(y)
    }

    /// `x` (.., R, d) turned as [`Table::rotate`] turns its rows, composed of candle's ops (any
    /// device): x cos + rotate_half(x) sin, as transformers writes it.
    pub(crate) fn rotate_tensor(&self, x: &Tensor, period: usize, turn: Turn) -> Result<Tensor> {
        let d = 2 * self.half;
        self.check(x.elem_count(), d, period)?;
        let table = |v: &[f32]| -> Result<Tensor> {
            let t = Tensor::from_slice(&v[..period * self.half], (period, self.half), x.device())?;
            Tensor::cat(&[&t, &t], D::Minus1)?.to_dtype(x.dtype()) // (period, d)
        };
        let (cos, sin) = (table(&self.cos)?, table(&self.sin)?);
        let sin = if turn == Turn::Forward { sin } else { sin.neg()? };
        let rows = x.reshape((x.elem_count() / (period * d), period, d))?;
        let (x1, x2) =
            (rows.narrow(D::Minus1, 0, self.half)?, rows.narrow(D::Minus1, self.half, self.half)?);
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        (rows.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?.reshape(x.shape())
    }

    fn check(&self, elements: usize, d: usize, period: usize) -> Result<()> {
        if period == 0 || period > self.positions() || !elements.is_multiple_of(period * d) {
            candle_core::bail!(
                "rotary embedding: {elements} elements are not rows of {d} features in blocks of \
                 {period} positions (the table has {})",
                self.positions()
            )
        }
        Ok(())
    }
}
