//! Building a block's operand matrix in the convolution's layout: the column matrix from the
//! input as it is (vol2col), or the patch matrix from the block's input channels-last, made again
//! only when a block reads samples or planes it does not hold ([`ChannelsLast`]). Every entry is
//! written, zeros where the kernel reads padding, so the workspace is never cleared. Not here:
//! its layout (`layout`), the products (`convolve`, `backward`), col2vol (`backward`).

use super::blocks::ConvBlock;
use super::input::Input;
use super::layout::Layout;
use super::shape::Conv3dShape;
use crate::fused::elem::Elem;
use crate::fused::uninit::uninit;
use rayon::prelude::*;
use std::ops::Range;

impl Conv3dShape {
    /// Writes block `b`'s operand matrix in this convolution's layout into the front of `buf`:
    /// the patch matrix from the block's samples channels-last (`xc`), or the column matrix
    /// from x.
    pub(super) fn operand<T: Elem>(
        &self,
        x: Input<T>,
        xc: &mut ChannelsLast<T>,
        b: &ConvBlock,
        buf: &mut [T],
    ) {
        match self.layout() {
            Layout::Patches => self.patches(xc.of(self, x, b), b, buf),
            Layout::Columns => self.vol2col(x.first, b, buf),
        }
    }

    /// Writes the column matrix (rows, samples x block_len) of block `b` of the batch x (N, C, D,
    /// H, W) into the front of `col`, every entry of it (zeros where the kernel reads padding, so
    /// the workspace is never cleared), one row per task.
    fn vol2col<T: Elem>(&self, x: &[T], b: &ConvBlock, col: &mut [T]) {
        let (len, sample, s, ow) =
            (self.block_len(b), self.c * self.volume(), self.stride[2], self.output[2]);
        let width = b.samples.len() * len;
        col[..self.rows() * width].par_chunks_mut(width).enumerate().for_each(|(r, row)| {
            let span = self.row_span(r % self.kernel[2]);
            for (k, n) in b.samples.clone().enumerate() {
                let (xs, seg) =
                    (&x[n * sample..(n + 1) * sample], &mut row[k * len..(k + 1) * len]);
                self.for_row(r, b, |j, input| {
                    let line = &mut seg[j..j + ow];
                    let Some(i) = input else { return line.fill(T::zero()) };
                    line[..span.start].fill(T::zero());
                    line[span.end..].fill(T::zero());
                    let inside = &mut line[span.clone()];
                    if s == 1 {
                        inside.copy_from_slice(&xs[i..i + inside.len()]);
                    } else {
                        inside.iter_mut().zip(xs[i..].iter().step_by(s)).for_each(|(c, &v)| *c = v);
                    }
                });
            }
        });
    }

    /// Writes the patch matrix (samples x block_len, rows) of block `b` into the front of
    /// `patches`, from `xc`, the block's samples [`Self::channels_last`]: row j holds what output
    /// voxel j's kernel reads, in (kd, kh, kw, C) order, every entry (zeros where it reads
    /// padding, so the workspace is never cleared). One output line (`ow` voxels) per task. The
    /// column matrix transposed: stored this way it is a row-major left operand with the voxels
    /// as its long side, which gemm packs and runs at 2-3x the speed of the column matrix beside a
    /// few output channels (`benches/gemm.rs`).
    fn patches<T: Elem>(&self, xc: Slab<T>, b: &ConvBlock, patches: &mut [T]) {
        let (rows, len, c) = (self.rows(), self.block_len(b), self.c);
        let slab = xc.planes.len() * self.input[1] * self.input[2] * c;
        let ([_, kh, kw], [_, h, w], ow) = (self.kernel, self.input, self.output[2]);
        let (s, pad) = (self.stride[2], self.pad[2]);
        let lines = b.zs.len() * b.rows.len();
        // An element loop rather than `copy_from_slice`, whose call costs more than a run of a
        // few channels.
        let copy = |dst: &mut [T], src: &[T]| dst.iter_mut().zip(src).for_each(|(d, &v)| *d = v);
        patches[..b.samples.len() * len * rows].par_chunks_mut(ow * rows).enumerate().for_each(
            |(task, line)| {
                let (k, l) = (task / lines, task % lines);
                let (z, i) = (b.zs.start + l / b.rows.len(), b.rows.start + l % b.rows.len());
                let xs = &xc.data[k * slab..][..slab];
                for (j, patch) in line.chunks_mut(rows).enumerate() {
                    // The kernel's row at output column j lies inside the input's width.
                    let inside = j * s >= pad && j * s + kw <= w + pad;
                    for (ap, seg) in patch.chunks_exact_mut(kw * c).enumerate() {
                        let (Some(zz), Some(ii)) =
                            (self.source(0, z, ap / kh), self.source(1, i, ap % kh))
                        else {
                            seg.fill(T::zero());
                            continue;
                        };
                        // The input row's first voxel.
                        let row = ((zz - xc.planes.start) * h + ii) * w;
                        if inside && s == 1 {
                            copy(seg, &xs[(row + j - pad) * c..][..kw * c]);
                            continue;
                        }
                        for (q, part) in seg.chunks_exact_mut(c).enumerate() {
                            match self.source(2, j, q) {
                                Some(jj) => copy(part, &xs[(row + jj) * c..][..c]),
                                None => part.fill(T::zero()),
                            }
                        }
                    }
                }
            },
        );
    }

    /// Input depth planes `planes` of samples `samples` of x (N, C, D, H, W) channels-last,
    /// (samples, planes, H, W, C): each voxel's channels side by side, so a patch row copies runs
    /// of C elements (kw C at unit stride). One run of 64 voxels per task, its channels read in
    /// order.
    fn channels_last<T: Elem>(
        &self,
        x: Input<T>,
        samples: Range<usize>,
        planes: Range<usize>,
    ) -> Vec<T> {
        const RUN: usize = 64;
        let (c, volume, plane) = (self.c, self.volume(), self.input[1] * self.input[2]);
        let slab = planes.len() * plane;
        // SAFETY: each task writes all C entries of each of its voxels.
        let mut out = unsafe { uninit(samples.len() * slab * c) };
        out.par_chunks_mut(slab * c).zip(samples).for_each(|(sample, n)| {
            sample.par_chunks_mut(RUN * c).enumerate().for_each(|(task, dst)| {
                let (v0, len) = (planes.start * plane + task * RUN, dst.len() / c);
                for ch in 0..c {
                    for (v, &value) in x.channel(n, ch, c, volume)[v0..][..len].iter().enumerate() {
                        dst[v * c + ch] = value;
                    }
                }
            });
        });
        out
    }

    /// The input depth planes that output slices `zs` read.
    fn planes(&self, zs: &Range<usize>) -> Range<usize> {
        let (depth, stride, pad) = (self.input[0], self.stride[0], self.pad[0]);
        let start = (zs.start * stride).saturating_sub(pad).min(depth);
        start
            ..((zs.end.max(1) - 1) * stride + self.kernel[0])
                .saturating_sub(pad)
                .clamp(start, depth)
    }
}

/// The current block's input channels-last ([`Conv3dShape::channels_last`]), made again only when
/// a block reads samples or depth planes it does not hold (a sample's slices and rows come in a
/// run; blocks never hold no samples, so the empty start is never taken for one).
pub(super) struct ChannelsLast<T> {
    samples: Range<usize>,
    planes: Range<usize>,
    data: Vec<T>,
}

/// Input planes channels-last, as [`Conv3dShape::patches`] reads them.
struct Slab<'a, T> {
    data: &'a [T],
    planes: Range<usize>,
}

impl<T: Elem> ChannelsLast<T> {
    pub(super) fn new() -> Self {
        ChannelsLast { samples: 0..0, planes: 0..0, data: Vec::new() }
    }

    /// Block `b`'s input channels-last, made anew where the last one made does not hold it:
    /// whole samples for a block spanning them, else a slab of depth planes from the block's
    /// first on, about a quarter of a block's entries or what the block reads if more (a
    /// sample made whole at once was a convolution backward's largest temporary, the size of
    /// its input; each plane is now made about once more per four blocks).
    fn of(&mut self, s: &Conv3dShape, x: Input<T>, b: &ConvBlock) -> Slab<'_, T> {
        let need = s.planes(&b.zs);
        if self.samples != b.samples || need.start < self.planes.start || need.end > self.planes.end
        {
            let plane = b.samples.len() * s.input[1] * s.input[2] * s.c;
            let planes = need.start
                ..(need.start + (s.block_entries / 4 / plane.max(1)).max(need.len()))
                    .min(s.input[0]);
            self.data = Vec::new(); // freed before the next is made
            self.data = s.channels_last(x, b.samples.clone(), planes.clone());
            (self.samples, self.planes) = (b.samples.clone(), planes);
        }
        Slab { data: &self.data, planes: self.planes.clone() }
    }
}
