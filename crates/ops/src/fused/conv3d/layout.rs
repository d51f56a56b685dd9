//! How a block's operand matrix is stored ([`Layout`]): the column matrix (rows, voxels) for a
//! few input channels, else the patch matrix (voxels, rows); and the kernel reordered to match it
//! (flipped for an input gradient, [`Kernel`]), the weight gradient made in it put back in w's
//! order. Not here: building the matrix (`operand_matrix`).

use super::shape::Conv3dShape;
use super::Kernel;
use crate::fused::elem::Elem;
use crate::fused::matmul::{mat, Mat};
use crate::fused::uninit::uninit;
use rayon::prelude::*;
use std::borrow::Cow;

/// How a block's operand matrix is stored: the column matrix (rows, voxels) or the patch matrix
/// (voxels, rows).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Layout {
    Columns,
    Patches,
}

impl Conv3dShape {
    /// The operand matrix this convolution's products take: the column matrix for a few input
    /// channels (a patch row would copy runs too short to pay), else the patch matrix.
    pub(super) fn layout(&self) -> Layout {
        if self.c >= 8 {
            Layout::Patches
        } else {
            Layout::Columns
        }
    }

    /// The kernel as this convolution's layout takes it, (O, C kd kh kw) for columns and
    /// (O, kd kh kw C) for patches, from w (O, C, kd, kh, kw): `w` itself where the two orders
    /// agree (columns, or a pointwise kernel); with [`Kernel::Flipped`], from the kernel of the
    /// convolution whose input gradient this one is, w (C, O, kd, kh, kw), turned end over end
    /// along all three axes ([`Self::transposed`]).
    pub(super) fn kernel<'w, T: Elem>(&self, w: &'w [T], kernel: Kernel) -> Cow<'w, [T]> {
        let (c, k) = (self.c, self.rows() / self.c);
        let patches = self.layout() == Layout::Patches;
        if kernel == Kernel::AsIs && (!patches || k == 1) {
            return Cow::Borrowed(w);
        }
        let at = |ch: usize, i: usize| if patches { i * c + ch } else { ch * k + i };
        // SAFETY: each task writes every entry of its output channels.
        let mut out = unsafe { uninit(w.len()) };
        if kernel == Kernel::Flipped {
            // A task per block of output channels, reading each input channel's k x block run
            // of w in order: one output channel per task read w at a stride of O k per element.
            const BLOCK: usize = 16;
            out.par_chunks_mut(BLOCK * c * k).enumerate().for_each(|(task, dst)| {
                let o0 = task * BLOCK;
                for ch in 0..c {
                    for (j, dst) in dst.chunks_mut(c * k).enumerate() {
                        let src = &w[(ch * self.o + o0 + j) * k..][..k];
                        for i in 0..k {
                            dst[at(ch, i)] = src[k - 1 - i];
                        }
                    }
                }
            });
        } else {
            out.par_chunks_mut(c * k).zip(w.par_chunks(c * k)).for_each(|(dst, src)| {
                for ch in 0..c {
                    for i in 0..k {
                        dst[at(ch, i)] = src[ch * k + i];
                    }
                }
            });
        }
        Cow::Owned(out)
    }

    /// A weight gradient made in this convolution's layout as w (O, C, kd, kh, kw) stores it.
    pub(super) fn natural<T: Elem>(&self, dw: Vec<T>) -> Vec<T> {
        if self.layout() == Layout::Columns {
            return dw;
        }
        let (c, k) = (self.c, self.rows() / self.c);
        // SAFETY: each task writes every entry of its output channel.
        let mut out = unsafe { uninit(dw.len()) };
        out.par_chunks_mut(c * k).zip(dw.par_chunks(c * k)).for_each(|(dst, src)| {
            for ch in 0..c {
                for i in 0..k {
                    dst[ch * k + i] = src[i * c + ch];
                }
            }
        });
        out
    }

    /// A block's operand matrix as the (samples x len, rows) matrix of [`Self::patches`]: the
    /// column matrix is its transpose.
    pub(super) fn matrix<'a, T>(&self, buf: &'a [T]) -> Mat<'a, T> {
        match self.layout() {
            Layout::Columns => mat(buf).transposed(),
            Layout::Patches => mat(buf),
        }
    }
}
