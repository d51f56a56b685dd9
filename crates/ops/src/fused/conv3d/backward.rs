//! The 3D convolution's gradients: the weight gradient directly where the direct kernels take it,
//! else by matrix products (per sample for a 1x1x1 kernel, else per block of the operand
//! matrix); the input gradient as a convolution of the output gradient where the stride is one,
//! else per block the column matrix's gradient added back into the input's (col2vol). Not here:
//! the op that calls it (`op`), the convolutions it runs (`convolve`).

use super::blocks::ConvBlock;
use super::input::Input;
use super::op::Conv3dOp;
use super::operand_matrix::ChannelsLast;
use super::shape::Conv3dShape;
use super::{direct, Kernel};
use crate::fused::elem::Elem;
use crate::fused::matmul::{mat, matmul, Dest};
use crate::fused::op::Want;
use crate::fused::uninit::uninit;
use candle_core::Result;
use rayon::prelude::*;

impl Conv3dOp {
    /// dW = sum over blocks of gy @ the block's operand matrix (pointwise: gy_n @ x_n^T summed
    /// over samples, in place); dx = the [`Conv3dShape::transposed`] convolution of gy where the
    /// stride is one, else per block col2vol(W^T @ gy) (both in [`Conv3dShape::by_blocks`]).
    /// Blocks in order, so the sums are too. dx comes as one tensor per part of the input.
    /// `want`: whether dx and dW are wanted (an image with no variable upstream, a frozen
    /// weight): those not wanted are not computed, and come back empty.
    pub(super) fn backward<T: Elem>(
        &self,
        x: Input<T>,
        w: &[T],
        gy: &[T],
        want: Want,
    ) -> Result<(Vec<Vec<T>>, Vec<T>)> {
        let s = &self.shape;
        let joined = s.joined(x);
        let x = joined.as_deref().map_or(x, |x| Input::whole(x, s.c));
        // dW directly where the direct kernels take it, else by matrix products: per sample for
        // a pointwise kernel, else in the blocks' loop, which makes dx too where the stride is
        // not one.
        if let Some(sub) = s.subsampled() {
            let dw = match want.dw {
                true => sub.pointwise_weight_gradient(&s.subsample(x), gy),
                false => Vec::new(),
            };
            if !want.dx {
                return Ok((Vec::new(), dw));
            }
            let gy = Input::whole(gy, s.o);
            let dxs = sub.transposed().convolve_any(gy, w, Kernel::Flipped, &[s.c]);
            return Ok((self.split_by_parts(s.spread(&dxs[0])), dw));
        }
        let direct_dw = if want.dw { s.weight_gradient_directly(x, gy) } else { None };
        let looped_dw = want.dw && direct_dw.is_none();
        let transposed_dx = || {
            let t = s.transposed();
            if want.dx {
                t.convolve_any(Input::whole(gy, s.o), w, Kernel::Flipped, &self.parts())
            } else {
                Vec::new()
            }
        };
        if s.pointwise() {
            let dw = if looped_dw { s.pointwise_weight_gradient(x.first, gy) } else { Vec::new() };
            return Ok((transposed_dx(), direct_dw.unwrap_or(dw)));
        }
        let strided = !s.unit_stride();
        let col2vol = strided && want.dx;
        if !(looped_dw || col2vol) {
            return Ok((transposed_dx(), direct_dw.unwrap_or_default()));
        }
        let (dx, looped) = s.by_blocks(x, w, gy, Want { dx: col2vol, dw: looped_dw });
        let dw = direct_dw.unwrap_or(looped);
        if !strided {
            return Ok((transposed_dx(), dw));
        }
        if !want.dx {
            return Ok((Vec::new(), dw));
        }
        Ok((self.split_by_parts(dx), dw))
    }

    /// A strided convolution's input gradient `dx` (N, C, input), one tensor per part of the
    /// input: split by channels where it is in two parts (no model here has one).
    fn split_by_parts<T: Elem>(&self, dx: Vec<T>) -> Vec<Vec<T>> {
        let (c, volume) = (self.shape.c, self.shape.volume());
        match self.split {
            None => vec![dx],
            Some(split) => [0..split, split..c]
                .map(|r| {
                    dx.chunks(c * volume)
                        .flat_map(|x_n| &x_n[r.start * volume..r.end * volume])
                        .copied()
                        .collect()
                })
                .into(),
        }
    }
}

impl Conv3dShape {
    /// The weight gradient (O, C, kd, kh, kw) from the output gradient gy, directly where the
    /// direct kernels take it (f32, `direct::WeightPlan::of`).
    fn weight_gradient_directly<T: Elem>(&self, x: Input<T>, gy: &[T]) -> Option<Vec<T>> {
        let plan = direct::WeightPlan::of(self)?;
        let x = Input { first: T::f32s(x.first)?, second: T::f32s(x.second)?, split: x.split };
        T::from_f32s(direct::weight_gradient(self, plan, x, T::f32s(gy)?))
    }

    /// The blocks' loop of a backward: per block, in order, dW += gy @ the block's operand matrix
    /// where `want.dw` (the weight gradient by matrix products), and where `want.dx` (a strided
    /// input gradient) the block's column-matrix gradient W^T @ gy added back into dx by
    /// [`Self::col2vol`]. Returns dx (N, C, input) and dW as w stores it (O, C, kd, kh, kw), each
    /// empty where not wanted; its workspaces are gone before dW is put in w's order and before
    /// the caller's input-gradient convolution makes its own.
    fn by_blocks<T: Elem>(&self, x: Input<T>, w: &[T], gy: &[T], want: Want) -> (Vec<T>, Vec<T>) {
        let rows = self.rows();
        let mut dw = if want.dw { vec![T::zero(); w.len()] } else { Vec::new() };
        let mut dx =
            if want.dx { vec![T::zero(); self.n * self.c * self.volume()] } else { Vec::new() };
        let blocks = self.blocks();
        let widest = self.widest(&blocks);
        let several = blocks.iter().any(|b| b.samples.len() > 1);
        // SAFETY: each block writes the part of each workspace it reads: `operand` writes `buf`,
        // the gather `g`, the product `dcol`. The operand matrix only for the weight gradient:
        // the input gradient's product reads the kernel and the output gradient.
        let (mut buf, mut g, mut dcol) = unsafe {
            (
                uninit(if want.dw { widest * rows } else { 0 }),
                uninit(if several { self.o * widest } else { 0 }),
                uninit(if want.dx { rows * widest } else { 0 }),
            )
        };
        let mut xc = ChannelsLast::new();
        for b in &blocks {
            let len = self.block_len(b);
            let width = b.samples.len() * len;
            let gb = self.block_gradient(gy, b, &mut g);
            if want.dw {
                self.operand(x, &mut xc, b, &mut buf);
                // += (O, rows) in the layout's order
                let m = self.matrix(&buf[..width * rows]);
                matmul(&mut dw, gb, m, (self.o, width, rows), Dest::Accumulate);
            }
            if want.dx {
                // (rows, samples x len)
                let dcol = &mut dcol[..rows * width];
                matmul(dcol, mat(w).transposed(), gb, (rows, self.o, width), Dest::Overwrite);
                self.col2vol(dcol, b, &mut dx);
            }
        }
        drop((buf, g, dcol, xc));
        let dw = if want.dw { self.natural(dw) } else { dw };
        (dx, dw)
    }

    /// Adds block `b`'s column-matrix entries back into the batch's gradient dx (N, C, D, H, W),
    /// one (sample, channel) per task and its rows in order.
    fn col2vol<T: Elem>(&self, col: &[T], b: &ConvBlock, dx: &mut [T]) {
        let (k, volume, len, s) =
            (self.rows() / self.c, self.volume(), self.block_len(b), self.stride[2]);
        let width = b.samples.len() * len;
        let batch = &mut dx[b.samples.start * self.c * volume..b.samples.end * self.c * volume];
        batch.par_chunks_mut(volume).enumerate().for_each(|(task, xc)| {
            let (sample, c) = (task / self.c, task % self.c);
            for r in c * k..(c + 1) * k {
                let row = &col[r * width + sample * len..r * width + (sample + 1) * len];
                let span = self.row_span(r % self.kernel[2]);
                self.for_row(r, b, |j, input| {
                    if let Some(i) = input {
                        let i = i - c * volume;
                        xc[i..]
                            .iter_mut()
                            .step_by(s)
                            .zip(&row[j + span.start..j + span.end])
                            .for_each(|(x, &g)| *x += g);
                    }
                });
            }
        });
    }
}
