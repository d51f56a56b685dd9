//! The blocks the operand matrix is built and multiplied in, so that its workspace stays within
//! a size whatever the problem's: whole samples side by side, runs of a sample's depth slices, or
//! runs of a slice's output rows ([`ConvBlock`]); where each output line of a block reads the
//! input; and the output gradient's columns of a block, gathered side by side. Not here: what
//! is built in a block (`operand_matrix`).

use super::shape::Conv3dShape;
use crate::fused::elem::Elem;
use crate::fused::matmul::{mat, Mat};
use rayon::prelude::*;
use std::ops::Range;

/// A block of the column matrix: output rows `rows` of depth slices `zs` of samples `samples`,
/// side by side (`rows` is a part of the plane only in a block of one slice of one sample).
pub(super) struct ConvBlock {
    pub(super) samples: Range<usize>,
    pub(super) zs: Range<usize>,
    pub(super) rows: Range<usize>,
}

impl Conv3dShape {
    /// The blocks of the column matrix, in order, each at most about `block_entries` entries
    /// (at least one output row): whole samples side by side while a sample fits (a layer with few
    /// output voxels per sample still gets one wide matrix product), else one sample's output
    /// depth slices in runs, else one depth slice's output rows in runs.
    pub(super) fn blocks(&self) -> Vec<ConvBlock> {
        let [depth, oh, ow] = self.output;
        let (per_row, n) = (self.rows() * ow, self.n);
        let fit = |unit: usize, max: usize| (self.block_entries / unit.max(1)).clamp(1, max);
        let (rows, slices) = (fit(per_row, oh), fit(per_row * oh, depth));
        if rows < oh {
            let runs = move |z: usize| {
                (0..oh).step_by(rows).map(move |i| (z..z + 1, i..(i + rows).min(oh)))
            };
            return (0..n)
                .flat_map(|s| {
                    (0..depth).flat_map(runs).map(move |(zs, is)| ConvBlock {
                        samples: s..s + 1,
                        zs,
                        rows: is,
                    })
                })
                .collect();
        }
        if slices < depth {
            return (0..n)
                .flat_map(|s| {
                    (0..depth).step_by(slices).map(move |z| ConvBlock {
                        samples: s..s + 1,
                        zs: z..(z + slices).min(depth),
                        rows: 0..oh,
                    })
                })
                .collect();
        }
        let samples = fit(per_row * oh * depth, n);
        (0..n)
            .step_by(samples)
            .map(|s| ConvBlock { samples: s..(s + samples).min(n), zs: 0..depth, rows: 0..oh })
            .collect()
    }

    /// The output columns j whose input column `j s + q - pad` lies inside the input's width, for
    /// kernel column `q`.
    pub(super) fn row_span(&self, q: usize) -> Range<usize> {
        let (s, pad, w, ow) = (self.stride[2], self.pad[2], self.input[2], self.output[2]);
        let lo = pad.saturating_sub(q).div_ceil(s).min(ow);
        lo..((w + pad).saturating_sub(q)).div_ceil(s).clamp(lo, ow)
    }

    /// Calls `f(column, input)` for every output line (one depth slice, one output row: `ow`
    /// columns) of block `b` (one sample's part) in row `r` of the column matrix: `column` is where
    /// the line starts, counted from the block's start; `input` is the input index that column
    /// `span.start` of the line reads (the next `span.len()` columns read every `s`-th element on
    /// from it, `span` as [`Self::row_span`] gives it), or `None` where the line reads only
    /// padding.
    pub(super) fn for_row(&self, r: usize, b: &ConvBlock, mut f: impl FnMut(usize, Option<usize>)) {
        let [kd, kh, kw] = self.kernel;
        let [d, h, w] = self.input;
        let ow = self.output[2];
        let (c, a, p, q) = (r / (kd * kh * kw), (r / (kh * kw)) % kd, (r / kw) % kh, r % kw);
        let span = self.row_span(q);
        for z in b.zs.clone() {
            let zz = self.source(0, z, a);
            for i in b.rows.clone() {
                let column = ((z - b.zs.start) * b.rows.len() + i - b.rows.start) * ow;
                let input = match (zz, self.source(1, i, p)) {
                    (Some(zz), Some(ii)) if !span.is_empty() => Some(
                        ((c * d + zz) * h + ii) * w + span.start * self.stride[2] + q - self.pad[2],
                    ),
                    _ => None,
                };
                f(column, input);
            }
        }
    }

    /// Columns per sample in block `b`.
    pub(super) fn block_len(&self, b: &ConvBlock) -> usize {
        b.zs.len() * b.rows.len() * self.output[2]
    }

    /// Where block `b`'s columns start in a sample's output plane (they are contiguous there).
    pub(super) fn block_start(&self, b: &ConvBlock) -> usize {
        (b.zs.start * self.output[1] + b.rows.start) * self.output[2]
    }

    /// Columns of the widest block: the workspaces' width.
    pub(super) fn widest(&self, blocks: &[ConvBlock]) -> usize {
        blocks.iter().map(|b| b.samples.len() * self.block_len(b)).max().unwrap_or(0)
    }

    /// The output gradient's columns of block `b`, (O, samples x len): `gy` (N, O, output) itself
    /// where the block is one sample's, else gathered into the workspace `g`.
    pub(super) fn block_gradient<'a, T: Elem>(
        &self,
        gy: &'a [T],
        b: &ConvBlock,
        g: &'a mut [T],
    ) -> Mat<'a, T> {
        let (cols, start, len) = (self.cols(), self.block_start(b), self.block_len(b));
        if b.samples.len() == 1 {
            return mat(&gy[b.samples.start * self.o * cols + start..]).ld(cols);
        }
        gather(gy, (self.o, cols), start..start + len, b.samples.clone(), g);
        mat(&g[..self.o * b.samples.len() * len])
    }
}

/// Columns `part` of each channel of `samples` of src (N, channels, cols) side by side into the
/// front of `dst`: (channels, samples x part), a channel per task.
pub(super) fn gather<T: Elem>(
    src: &[T],
    (channels, cols): (usize, usize),
    part: Range<usize>,
    samples: Range<usize>,
    dst: &mut [T],
) {
    let (len, width) = (part.len(), samples.len() * part.len());
    dst[..channels * width].par_chunks_mut(width).enumerate().for_each(|(ch, row)| {
        for (k, n) in samples.clone().enumerate() {
            row[k * len..(k + 1) * len]
                .copy_from_slice(&src[(n * channels + ch) * cols + part.start..][..len]);
        }
    });
}

/// [`gather`]'s inverse: src (channels, samples x part) into columns `part` of each channel of
/// `samples` of dst (N, channels, cols).
pub(super) fn scatter<T: Elem>(
    src: &[T],
    (channels, cols): (usize, usize),
    part: Range<usize>,
    samples: Range<usize>,
    dst: &mut [T],
) {
    let (len, width) = (part.len(), samples.len() * part.len());
    for (k, n) in samples.enumerate() {
        let dst_n = &mut dst[n * channels * cols..(n + 1) * channels * cols];
        for (d, row) in dst_n.chunks_mut(cols).zip(src.chunks(width)) {
            d[part.clone()].copy_from_slice(&row[k * len..(k + 1) * len]);
        }
    }
}
