//! 3D convolution by vol2col in blocks and a matrix product per block, the column matrix built
//! again in backward: keeps its input and output only.

use super::generic::GenericOp;
use super::{exactly, mat, matmul, matmul_new, operand, shaped, slice, widened, widened_as, with_slice, Elem, FusedOp, Operand};
use candle_core::{CpuStorage, Result, Shape, Tensor};
use rayon::prelude::*;

/// 3D convolution of x (N, C, D, H, W) with w (O, C, kd, kh, kw) by vol2col and a matrix product
/// per block of the column matrix (8 MB in f32 at most). It keeps nothing but its input and
/// output: the column matrix is built again in backward (the composed version in `src/conv3d.rs`
/// keeps 7 copies of its input).
pub(crate) fn conv3d(x: &Tensor, w: &Tensor, g: crate::Conv3dGeometry) -> Result<Tensor> {
    conv3d_blocked(x, w, g, 1 << 21)
}

/// [`conv3d`] building the column matrix in blocks of at most about `block_entries` entries (at
/// least one output row; see `Conv3dShape::blocks`).
pub(crate) fn conv3d_blocked(x: &Tensor, w: &Tensor, g: crate::Conv3dGeometry, block_entries: usize) -> Result<Tensor> {
    let shape = Conv3dShape::new(x.dims5()?, w.dims5()?, g, block_entries)?;
    x.contiguous()?.apply_op2(&operand(w, x)?, Conv3dOp { shape })
}

/// The generic route ([`super::generic`]): candle's 2D convolutions summed over kernel depth on
/// detached operands, and their backward composed the same way (`crate::conv3d`'s composed forms),
/// half precision computed in f32. Keeps what the kernel keeps: x and w.
pub(crate) fn conv3d_generic(x: &Tensor, w: &Tensor, g: crate::Conv3dGeometry) -> Result<Tensor> {
    let y = crate::conv3d::conv3d_composed(&widened(&x.detach())?, &widened_as(&w.detach(), x)?, g)?.to_dtype(x.dtype())?;
    let backward = move |inputs: &[Tensor], _y: &Tensor, grad: &Tensor| -> Result<Vec<Option<Tensor>>> {
        let [x, w] = exactly(&inputs.iter().collect::<Vec<_>>())?;
        let (dx, dw) = crate::conv3d::conv3d_composed_backward(&widened(x)?, &widened_as(w, x)?, &widened_as(grad, x)?, g)?;
        Ok(vec![Some(dx.to_dtype(x.dtype())?), Some(dw.to_dtype(w.dtype())?)])
    };
    x.contiguous()?.apply_op2(&w.contiguous()?, GenericOp::new("generic-conv3d", y, Box::new(backward)))
}

/// The sizes of one 3D convolution.
#[derive(Clone, Copy, Debug)]
struct Conv3dShape {
    n: usize,
    c: usize,
    o: usize,
    input: [usize; 3],
    kernel: [usize; 3],
    stride: [usize; 3],
    pad: [usize; 3],
    output: [usize; 3],
    block_entries: usize,
}

impl Conv3dShape {
    fn new(
        (n, c, d, h, w): (usize, usize, usize, usize, usize),
        (o, c_w, kd, kh, kw): (usize, usize, usize, usize, usize),
        g: crate::Conv3dGeometry,
        block_entries: usize,
    ) -> Result<Self> {
        if c != c_w {
            candle_core::bail!("conv3d: input has {c} channels, the kernel expects {c_w}")
        }
        let (input, kernel) = ([d, h, w], [kd, kh, kw]);
        let (stride, pad) = ([g.stride_d, g.stride_hw, g.stride_hw], [g.pad_d, g.pad_hw, g.pad_hw]);
        let mut output = [0; 3];
        for a in 0..3 {
            if input[a] + 2 * pad[a] < kernel[a] || stride[a] == 0 {
                candle_core::bail!("conv3d: input {input:?} padded by {pad:?} is smaller than the kernel {kernel:?}")
            }
            output[a] = (input[a] + 2 * pad[a] - kernel[a]) / stride[a] + 1;
        }
        Ok(Conv3dShape { n, c, o, input, kernel, stride, pad, output, block_entries })
    }

    /// Rows of the column matrix (C kd kh kw) and its columns (output voxels).
    fn rows(&self) -> usize {
        self.c * self.kernel.iter().product::<usize>()
    }

    fn cols(&self) -> usize {
        self.output.iter().product()
    }

    fn volume(&self) -> usize {
        self.input.iter().product()
    }

    /// For row r = (c, a, p, q) of the column matrix and output coordinate `out` along axis
    /// `axis`, the input coordinate it reads, if inside the input.
    fn source(&self, axis: usize, out: usize, k: usize) -> Option<usize> {
        (out * self.stride[axis] + k).checked_sub(self.pad[axis]).filter(|&v| v < self.input[axis])
    }

    /// The blocks of the column matrix, in order, each at most about `block_entries` entries
    /// (at least one output row): whole samples side by side while a sample fits (a layer with few
    /// output voxels per sample still gets one wide matrix product), else one sample's output
    /// depth slices in runs, else one depth slice's output rows in runs.
    fn blocks(&self) -> Vec<ConvBlock> {
        let [depth, oh, ow] = self.output;
        let (per_row, n) = (self.rows() * ow, self.n);
        let fit = |unit: usize, max: usize| (self.block_entries / unit.max(1)).clamp(1, max);
        let (rows, slices) = (fit(per_row, oh), fit(per_row * oh, depth));
        if rows < oh {
            let runs = move |z: usize| (0..oh).step_by(rows).map(move |i| (z..z + 1, i..(i + rows).min(oh)));
            return (0..n).flat_map(|s| (0..depth).flat_map(runs).map(move |(zs, is)| ConvBlock { samples: s..s + 1, zs, rows: is })).collect();
        }
        if slices < depth {
            return (0..n)
                .flat_map(|s| (0..depth).step_by(slices).map(move |z| ConvBlock { samples: s..s + 1, zs: z..(z + slices).min(depth), rows: 0..oh }))
                .collect();
        }
        let samples = fit(per_row * oh * depth, n);
        (0..n).step_by(samples).map(|s| ConvBlock { samples: s..(s + samples).min(n), zs: 0..depth, rows: 0..oh }).collect()
    }

    /// Calls `f(column, input index, n)` for every run of row `r` of the column matrix of block
    /// `b` (one sample's part) that reads the input: columns `column..column + n` read the input
    /// at `index`, `index + s`, ... with `s` the width stride. Columns count from the block's start.
    fn for_row(&self, r: usize, b: &ConvBlock, mut f: impl FnMut(usize, usize, usize)) {
        let [kd, kh, kw] = self.kernel;
        let [d, h, w] = self.input;
        let [_, _, ow] = self.output;
        let (c, a, p, q) = (r / (kd * kh * kw), (r / (kh * kw)) % kd, (r / kw) % kh, r % kw);
        // The output columns j whose input column j s + q - pad lies inside the row.
        let (s, pad) = (self.stride[2], self.pad[2]);
        let j_lo = pad.saturating_sub(q).div_ceil(s);
        let j_hi = ((w + pad).saturating_sub(q)).div_ceil(s).min(ow);
        if j_lo >= j_hi {
            return;
        }
        for z in b.zs.clone() {
            let Some(zz) = self.source(0, z, a) else { continue };
            for i in b.rows.clone() {
                let Some(ii) = self.source(1, i, p) else { continue };
                let column = ((z - b.zs.start) * b.rows.len() + i - b.rows.start) * ow + j_lo;
                f(column, ((c * d + zz) * h + ii) * w + j_lo * s + q - pad, j_hi - j_lo);
            }
        }
    }

    /// Columns per sample in block `b`.
    fn block_len(&self, b: &ConvBlock) -> usize {
        b.zs.len() * b.rows.len() * self.output[2]
    }

    /// Where block `b`'s columns start in a sample's output plane (they are contiguous there).
    fn block_start(&self, b: &ConvBlock) -> usize {
        (b.zs.start * self.output[1] + b.rows.start) * self.output[2]
    }

    /// The column matrix (rows, samples x block_len) of block `b` of the batch x (N, C, D, H, W),
    /// one row per task.
    fn vol2col<T: Elem>(&self, x: &[T], b: &ConvBlock) -> Vec<T> {
        let (len, sample) = (self.block_len(b), self.c * self.volume());
        let width = b.samples.len() * len;
        let mut col = vec![T::zero(); self.rows() * width];
        col.par_chunks_mut(width).enumerate().for_each(|(r, row)| {
            for (k, n) in b.samples.clone().enumerate() {
                let (xs, seg) = (&x[n * sample..(n + 1) * sample], &mut row[k * len..(k + 1) * len]);
                let s = self.stride[2];
                self.for_row(r, b, |j, i, n| {
                    if s == 1 {
                        seg[j..j + n].copy_from_slice(&xs[i..i + n]);
                    } else {
                        seg[j..j + n].iter_mut().zip(xs[i..].iter().step_by(s)).for_each(|(c, &v)| *c = v);
                    }
                });
            }
        });
        col
    }

    /// Adds block `b`'s column-matrix entries back into the batch's gradient dx (N, C, D, H, W),
    /// one (sample, channel) per task and its rows in order.
    fn col2vol<T: Elem>(&self, col: &[T], b: &ConvBlock, dx: &mut [T]) {
        let (k, volume, len) = (self.rows() / self.c, self.volume(), self.block_len(b));
        let width = b.samples.len() * len;
        let batch = &mut dx[b.samples.start * self.c * volume..b.samples.end * self.c * volume];
        batch.par_chunks_mut(volume).enumerate().for_each(|(task, xc)| {
            let (sample, c) = (task / self.c, task % self.c);
            for r in c * k..(c + 1) * k {
                let row = &col[r * width + sample * len..r * width + (sample + 1) * len];
                let s = self.stride[2];
                self.for_row(r, b, |j, i, n| {
                    let i = i - c * volume;
                    xc[i..].iter_mut().step_by(s).zip(&row[j..j + n]).for_each(|(x, &g)| *x += g);
                });
            }
        });
    }
}

/// A block of the column matrix: output rows `rows` of depth slices `zs` of samples `samples`,
/// side by side (`rows` is a part of the plane only in a block of one slice of one sample).
struct ConvBlock {
    samples: std::ops::Range<usize>,
    zs: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
}

struct Conv3dOp {
    shape: Conv3dShape,
}

impl Conv3dOp {
    fn forward<T: Elem>(&self, x: &[T], w: &[T]) -> Result<Vec<T>> {
        let s = &self.shape;
        let cols = s.cols();
        let mut y = vec![T::zero(); s.n * s.o * cols];
        for b in s.blocks() {
            let (start, len) = (s.block_start(&b), s.block_len(&b));
            let width = b.samples.len() * len;
            let out = matmul_new(mat(w, false), mat(&s.vol2col(x, &b), false), (s.o, s.rows(), width)); // (O, samples x len)
            for (k, n) in b.samples.clone().enumerate() {
                let y_n = &mut y[n * s.o * cols..(n + 1) * s.o * cols];
                for (y, row) in y_n.chunks_mut(cols).zip(out.chunks(width)) {
                    y[start..start + len].copy_from_slice(&row[k * len..(k + 1) * len]);
                }
            }
        }
        Ok(y)
    }

    /// Per block: dW += gy @ col^T, dx += col2vol(W^T @ gy); in order.
    fn backward<T: Elem>(&self, x: &[T], w: &[T], gy: &[T]) -> Result<(Vec<T>, Vec<T>)> {
        let s = &self.shape;
        let cols = s.cols();
        let mut dw = vec![T::zero(); w.len()];
        let mut dx = vec![T::zero(); x.len()];
        for b in s.blocks() {
            let (start, len) = (s.block_start(&b), s.block_len(&b));
            let width = b.samples.len() * len;
            // The output gradient's columns of this block, (O, samples x len).
            let g: Vec<T> = (0..s.o)
                .flat_map(|o| b.samples.clone().flat_map(move |n| gy[(n * s.o + o) * cols + start..(n * s.o + o) * cols + start + len].iter().copied()))
                .collect();
            matmul(&mut dw, mat(&g, false), mat(&s.vol2col(x, &b), true), (s.o, width, s.rows()), true); // += (O, rows)
            let dcol = matmul_new(mat(w, true), mat(&g, false), (s.rows(), s.o, width)); // (rows, samples x len)
            s.col2vol(&dcol, &b, &mut dx);
        }
        Ok((dx, dw))
    }
}

impl FusedOp for Conv3dOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let [(x, xl), (w, wl)] = exactly(inputs)?;
        let y = per_float!(x, "conv3d", self.forward(&slice(x, xl)?, &slice(w, wl)?)?);
        let s = &self.shape;
        Ok((y, Shape::from(vec![s.n, s.o, s.output[0], s.output[1], s.output[2]])))
    }

    fn bwd(&self, inputs: &[&Tensor], _y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [x, w] = exactly(inputs)?;
        let g = g.contiguous()?;
        let (dx, dw) = per_dtype!(x.dtype(), T => {
            let (dx, dw) = with_slice::<T, _>(x, |xs| with_slice(w, |ws| with_slice(&g, |gs| self.backward(xs, ws, gs))))?;
            (shaped(dx, x)?, shaped(dw, w)?)
        });
        Ok(vec![Some(dx), Some(dw)])
    }
}

custom_op!(Conv3dOp: 2 "fused-conv3d");
