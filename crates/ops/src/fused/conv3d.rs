//! 3D convolution: in f32 on AVX2 or AVX-512 directly ([`direct`]: forward, unit-stride input
//! gradient and weight gradient of every kernel but 1x1x1); else by an operand matrix built in
//! blocks (the column matrix, or for 8 or more input channels the patch matrix) and a matrix
//! product per block, none built for a 1x1x1 kernel (strided, of the voxels it reads, taken out
//! first). Its input gradient a convolution too where the stride is one: keeps its input and
//! output only.
//! Its input may come in two tensors whose channels side by side are the input (a U-Net decoder's
//! skip and up-sampled tensors): the concatenation is never made, nor kept.

use super::generic::{GenericOp, Replay};
use super::{
    apply2, apply3, exactly, kept_or, mat, matmul, matmul_alone, matmul_strided, operand, shaped,
    slice, sum_chunks, sums, uninit, widened, widened_as, with_slice, Elem, FusedOp, Operand,
};
use candle_core::{CpuStorage, Result, Shape, Tensor};
use rayon::prelude::*;
use std::borrow::Cow;
use std::ops::Range;

mod direct;

/// 3D convolution of x (N, C, D, H, W) with w (O, C, kd, kh, kw) by a matrix product per block
/// of its operand matrix (one workspace for all blocks, [`Conv3dShape::sized`]). It keeps nothing
/// but its input and output: the operand matrix is built again in backward (the composed version
/// in `src/conv3d.rs` keeps 7 copies of its input).
/// `kept`: its output, kept from the forward (`remat::keep`).
pub(crate) fn conv3d(
    x: &Tensor,
    w: &Tensor,
    g: super::Conv3dGeometry,
    kept: Option<Tensor>,
) -> Result<Tensor> {
    let shape = Conv3dShape::new(x.dims5()?, w.dims5()?, g, BLOCK_ENTRIES)?.sized();
    apply2(&x.contiguous()?, &operand(w, x)?, Conv3dOp { shape, split: None }, kept)
}

/// Entries of an operand-matrix block at most (4 MiB in f32): the one workspace's size. A decoder
/// level's backward holds it beside both input gradients, so it adds to the U-Net's step peak
/// (8 MiB blocks: 4 MiB more), while the products stay wide enough for gemm's blocking at no
/// measured cost in time (`bench-harness run-one`, U-Net small and ResNet-50/152).
const BLOCK_ENTRIES: usize = 1 << 20;

/// [`conv3d`] building the column matrix in blocks of at most about `block_entries` entries
/// whatever the problem's size (at least one output row; see `Conv3dShape::blocks`): the tests'
/// way to take each kind of block.
#[cfg(test)]
pub(crate) fn conv3d_blocked(
    x: &Tensor,
    w: &Tensor,
    g: super::Conv3dGeometry,
    block_entries: usize,
) -> Result<Tensor> {
    let shape = Conv3dShape::new(x.dims5()?, w.dims5()?, g, block_entries)?;
    apply2(&x.contiguous()?, &operand(w, x)?, Conv3dOp { shape, split: None }, None)
}

/// [`conv3d`] of the channel concatenation of a (N, Ca, D, H, W) and b (N, Cb, D, H, W) with w
/// (O, Ca + Cb, kd, kh, kw), without making it: the patch matrix reads each channel from where it
/// is, and the input gradient comes out as the two tensors' gradients. Keeps a, b and the output
/// (the concatenation and its two inputs, composed).
pub(crate) fn conv3d_concat(
    a: &Tensor,
    b: &Tensor,
    w: &Tensor,
    g: super::Conv3dGeometry,
    kept: Option<Tensor>,
) -> Result<Tensor> {
    let (x, split) = concat_dims(a, b)?;
    let shape = Conv3dShape::new(x, w.dims5()?, g, BLOCK_ENTRIES)?.sized();
    apply3(
        &a.contiguous()?,
        &b.contiguous()?,
        &operand(w, a)?,
        Conv3dOp { shape, split: Some(split) },
        kept,
    )
}

/// The generic route of [`conv3d_concat`]: as [`conv3d_generic`], the concatenation made inside
/// the op (forward and backward) and dropped there. Keeps what the kernel keeps: a, b and w.
pub(crate) fn conv3d_concat_generic(
    a: &Tensor,
    b: &Tensor,
    w: &Tensor,
    g: super::Conv3dGeometry,
    kept: Option<Tensor>,
) -> Result<Tensor> {
    let split = concat_dims(a, b)?.1;
    let y = kept_or(kept, || {
        let x = Tensor::cat(&[&widened(&a.detach())?, &widened(&b.detach())?], 1)?;
        super::conv3d_composed(&x, &widened_as(&w.detach(), a)?, g)?.to_dtype(a.dtype())
    })?;
    let backward = move |inputs: &[Tensor],
                         _y: &Tensor,
                         grad: &Tensor,
                         want: &[bool]|
          -> Result<Vec<Option<Tensor>>> {
        let [a, b, w] = exactly(&inputs.iter().collect::<Vec<_>>())?;
        let x = Tensor::cat(&[&widened(a)?, &widened(b)?], 1)?;
        let (dx, dw) = super::conv3d_composed_backward(
            &x,
            &widened_as(w, a)?,
            &widened_as(grad, a)?,
            g,
            (want[0] || want[1], want[2]),
        )?;
        let part = |t: &Tensor, (start, len), like: &Tensor, wanted: bool| {
            wanted
                .then(|| t.narrow(1, start, len)?.to_dtype(like.dtype())?.contiguous())
                .transpose()
        };
        let (da, db) = match &dx {
            Some(dx) => (
                part(dx, (0, split), a, want[0])?,
                part(dx, (split, dx.dim(1)? - split), b, want[1])?,
            ),
            None => (None, None),
        };
        Ok(vec![da, db, dw.map(|dw| dw.to_dtype(w.dtype())).transpose()?])
    };
    a.contiguous()?.apply_op3(
        &b.contiguous()?,
        &w.contiguous()?,
        GenericOp::new("generic-conv3d-concat", y, Box::new(backward)),
    )
}

/// (N, C, D, H, W) of a 3D convolution's input.
type Dims5 = (usize, usize, usize, usize, usize);

/// An input gradient and a weight gradient, each where it was asked for.
pub(super) type Gradients<T> = (Option<Vec<T>>, Option<Vec<T>>);

/// The input and weight gradients of a transposed convolution with kernel = stride = 2 of x (N,
/// C, D, H, W) by w (C, O, 2, 2, 2), from its output gradient gy (N, O, 2D, 2H, 2W), by the
/// direct kernels where they take it (f32): dx is the convolution of gy with w at stride 2 (each
/// input voxel's gradient is what its 2x2x2 output block's gradient makes through w), and dW that
/// convolution's weight gradient with x as its output gradient. Each where `want` asks for it.
pub(super) fn k2s2_gradients_directly<T: Elem>(
    x: &[T],
    w: &[T],
    gy: &[T],
    (n, c, o, [d, h, wd]): (usize, usize, usize, [usize; 3]),
    want: (bool, bool),
) -> Option<Gradients<T>> {
    let g = super::Conv3dGeometry { stride_d: 2, stride_hw: 2, pad_d: 0, pad_hw: 0 };
    let s = Conv3dShape::new((n, o, 2 * d, 2 * h, 2 * wd), (c, o, 2, 2, 2), g, BLOCK_ENTRIES)
        .ok()?
        .sized();
    let (plan, weight_plan) = (direct::Plan::of(&s)?, direct::WeightPlan::of(&s)?);
    let (x, w, gy) = (T::f32s(x)?, T::f32s(w)?, T::f32s(gy)?);
    let gy = Input::whole(gy, o);
    let dx = want.0.then(|| direct::convolve(&s, plan, gy, w, false, &s.part_ranges(&[c])));
    let dw = want.1.then(|| direct::weight_gradient(&s, weight_plan, gy, x));
    let typed = |v: Option<Vec<f32>>| match v {
        Some(v) => T::from_f32s(v).map(Some),
        None => Some(None),
    };
    Some((typed(dx.map(|mut dx| dx.remove(0)))?, typed(dw)?))
}

/// The dims of the channel concatenation of a and b, and a's channels; both must agree elsewhere.
fn concat_dims(a: &Tensor, b: &Tensor) -> Result<(Dims5, usize)> {
    let ((n, ca, d, h, w), (nb, cb, db, hb, wb)) = (a.dims5()?, b.dims5()?);
    if (n, d, h, w) != (nb, db, hb, wb) || a.dtype() != b.dtype() {
        candle_core::bail!(
            "conv3d_concat: {:?} {:?} and {:?} {:?} differ beyond their channels",
            a.dims(),
            a.dtype(),
            b.dims(),
            b.dtype()
        )
    }
    Ok(((n, ca + cb, d, h, w), ca))
}

/// A convolution's input (N, C, D, H, W): one tensor's elements, or two tensors' whose channels
/// side by side are the input (`first` holds channels `..split`).
#[derive(Clone, Copy)]
struct Input<'a, T> {
    first: &'a [T],
    second: &'a [T],
    split: usize,
}

impl<'a, T: Elem> Input<'a, T> {
    fn whole(x: &'a [T], c: usize) -> Self {
        Input { first: x, second: &[], split: c }
    }

    /// Channel `ch` of sample `n`, `volume` elements.
    fn channel(&self, n: usize, ch: usize, c: usize, volume: usize) -> &'a [T] {
        match ch.checked_sub(self.split) {
            None => &self.first[(n * self.split + ch) * volume..][..volume],
            Some(ch) => &self.second[(n * (c - self.split) + ch) * volume..][..volume],
        }
    }
}

/// The generic route ([`super::generic`]): candle's 2D convolutions summed over kernel depth on
/// detached operands, and their backward composed the same way (the `composed` module's),
/// half precision computed in f32. Keeps what the kernel keeps: x and w.
pub(crate) fn conv3d_generic(
    x: &Tensor,
    w: &Tensor,
    g: super::Conv3dGeometry,
    kept: Option<Tensor>,
) -> Result<Tensor> {
    let y = kept_or(kept, || {
        super::conv3d_composed(&widened(&x.detach())?, &widened_as(&w.detach(), x)?, g)?
            .to_dtype(x.dtype())
    })?;
    let backward = move |inputs: &[Tensor],
                         _y: &Tensor,
                         grad: &Tensor,
                         want: &[bool]|
          -> Result<Vec<Option<Tensor>>> {
        let [x, w] = exactly(&inputs.iter().collect::<Vec<_>>())?;
        let (dx, dw) = super::conv3d_composed_backward(
            &widened(x)?,
            &widened_as(w, x)?,
            &widened_as(grad, x)?,
            g,
            (want[0], want[1]),
        )?;
        Ok(vec![
            dx.map(|dx| dx.to_dtype(x.dtype())).transpose()?,
            dw.map(|dw| dw.to_dtype(w.dtype())).transpose()?,
        ])
    };
    x.contiguous()?
        .apply_op2(&w.contiguous()?, GenericOp::new("generic-conv3d", y, Box::new(backward)))
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
        g: super::Conv3dGeometry,
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
                candle_core::bail!(
                    "conv3d: input {input:?} padded by {pad:?} is smaller than the kernel \
                     {kernel:?}"
                )
            }
            output[a] = (input[a] + 2 * pad[a] - kernel[a]) / stride[a] + 1;
        }
        Ok(Conv3dShape { n, c, o, input, kernel, stride, pad, output, block_entries })
    }

    /// This convolution with blocks of at most twice the entries of the largest tensor it reads
    /// or writes (input, output, kernel), where that is fewer than its `block_entries`: each of
    /// its workspaces (operand block, gathered gradient, channels-last slab) is then of the order
    /// of its own tensors, so a small problem pays for its own size, not for the 4 MiB a large one
    /// needs (at the tiny U-Net, blocks of 2^20 entries made the kernels' step peak four times
    /// the composed route's; now it is 0.98x). The products stay at least 2 O columns wide (the
    /// kernel has O x rows entries), wide enough for gemm's blocking; twice, not once, so that
    /// a batch of 5 or more images of a 3x3 convolution still takes whole images per block (9
    /// times an image's input: at once, the kernel bench's `conv2d 3x3 (8, 64, 32, 32)` split
    /// each image into blocks 896 and 128 columns wide).
    fn sized(self) -> Self {
        let largest = (self.n * self.c * self.volume())
            .max(self.n * self.o * self.cols())
            .max(self.o * self.rows());
        Conv3dShape { block_entries: self.block_entries.min(2 * largest), ..self }
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
    fn row_span(&self, q: usize) -> Range<usize> {
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
    fn for_row(&self, r: usize, b: &ConvBlock, mut f: impl FnMut(usize, Option<usize>)) {
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
    fn block_len(&self, b: &ConvBlock) -> usize {
        b.zs.len() * b.rows.len() * self.output[2]
    }

    /// Where block `b`'s columns start in a sample's output plane (they are contiguous there).
    fn block_start(&self, b: &ConvBlock) -> usize {
        (b.zs.start * self.output[1] + b.rows.start) * self.output[2]
    }

    /// Columns of the widest block: the workspaces' width.
    fn widest(&self, blocks: &[ConvBlock]) -> usize {
        blocks.iter().map(|b| b.samples.len() * self.block_len(b)).max().unwrap_or(0)
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

    /// The operand matrix this convolution's products take: the column matrix for a few input
    /// channels (a patch row would copy runs too short to pay), else the patch matrix.
    fn layout(&self) -> Layout {
        if self.c >= 8 {
            Layout::Patches
        } else {
            Layout::Columns
        }
    }

    /// The kernel as this convolution's layout takes it, (O, C kd kh kw) for columns and
    /// (O, kd kh kw C) for patches, from w (O, C, kd, kh, kw): `w` itself where the two orders
    /// agree (columns, or a pointwise kernel); with `flip`, from the kernel of the convolution
    /// whose input gradient this one is, w (C, O, kd, kh, kw), turned end over end along all three
    /// axes ([`Self::transposed`]).
    fn kernel<'w, T: Elem>(&self, w: &'w [T], flip: bool) -> Cow<'w, [T]> {
        let (c, k) = (self.c, self.rows() / self.c);
        let patches = self.layout() == Layout::Patches;
        if !flip && (!patches || k == 1) {
            return Cow::Borrowed(w);
        }
        let at = |ch: usize, i: usize| if patches { i * c + ch } else { ch * k + i };
        // SAFETY: each task writes every entry of its output channels.
        let mut out = unsafe { uninit(w.len()) };
        if flip {
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
    fn natural<T: Elem>(&self, dw: Vec<T>) -> Vec<T> {
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

    /// Writes block `b`'s operand matrix in this convolution's layout into the front of `buf`:
    /// the patch matrix from the block's samples channels-last (`xc`), or the column matrix
    /// from x.
    fn operand<T: Elem>(
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

    /// The concatenation of a two-tensor input x where this convolution reads x's elements in
    /// place (the column matrix, the pointwise product); `None` where x serves as it is (one
    /// tensor, or the patch matrix, which reads each channel where it is: the decoders' case).
    fn joined<T: Elem>(&self, x: Input<T>) -> Option<Vec<T>> {
        let in_place = self.pointwise() || self.layout() == Layout::Columns;
        (in_place && !x.second.is_empty()).then(|| {
            (0..self.n)
                .flat_map(|n| {
                    (0..self.c)
                        .flat_map(move |ch| x.channel(n, ch, self.c, self.volume()).iter().copied())
                })
                .collect()
        })
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

    /// A kernel of one voxel, unit stride, no padding: the column matrix of a sample is the
    /// sample itself, so the convolution is one matrix product per sample and builds nothing.
    fn pointwise(&self) -> bool {
        self.kernel == [1; 3] && self.stride == [1; 3] && self.pad == [0; 3]
    }

    /// Unit stride, each padding smaller than its kernel side: the input gradient is then itself
    /// a convolution ([`Self::transposed`]).
    fn unit_stride(&self) -> bool {
        self.stride == [1; 3] && (0..3).all(|a| self.pad[a] < self.kernel[a])
    }

    /// Where this is a strided 1x1x1 kernel without padding (ResNet's downsampling shortcuts):
    /// the pointwise convolution of the voxels it reads, every stride-th, which [`Self::subsample`]
    /// gathers (through the operand matrix, a patch per voxel, it took 2x oneDNN's time).
    fn subsampled(&self) -> Option<Conv3dShape> {
        let strided = self.kernel == [1; 3] && self.pad == [0; 3] && self.stride != [1; 3];
        strided.then_some(Conv3dShape { input: self.output, stride: [1; 3], ..*self })
    }

    /// The voxels of x (N, C, input) that a strided 1x1x1 kernel reads: (N, C, output).
    fn subsample<T: Elem>(&self, x: Input<T>) -> Vec<T> {
        let ([_, h, w], [_, oh, ow], [sd, sh, sw]) = (self.input, self.output, self.stride);
        let cols = self.cols();
        // SAFETY: each task writes every voxel of its channel.
        let mut out = unsafe { uninit(self.n * self.c * cols) };
        out.par_chunks_mut(cols).enumerate().for_each(|(i, dst)| {
            let src = x.channel(i / self.c, i % self.c, self.c, self.volume());
            for (r, row) in dst.chunks_mut(ow).enumerate() {
                let from = src[((r / oh * sd) * h + r % oh * sh) * w..].iter().step_by(sw);
                row.iter_mut().zip(from).for_each(|(d, &v)| *d = v);
            }
        });
        out
    }

    /// The input gradient (N, C, input) of a strided 1x1x1 kernel from that of the voxels it read,
    /// `dxs` (N, C, output): each in its place, zero elsewhere.
    fn spread<T: Elem>(&self, dxs: &[T]) -> Vec<T> {
        let ([_, h, w], [_, oh, ow], [sd, sh, sw]) = (self.input, self.output, self.stride);
        let (cols, volume) = (self.cols(), self.volume());
        let mut dx = vec![T::zero(); self.n * self.c * volume];
        dx.par_chunks_mut(volume).zip(dxs.par_chunks(cols)).for_each(|(dst, src)| {
            for (r, row) in src.chunks(ow).enumerate() {
                let to = dst[((r / oh * sd) * h + r % oh * sh) * w..].iter_mut().step_by(sw);
                to.zip(row).for_each(|(d, &g)| *d = g);
            }
        });
        dx
    }

    /// The convolution that gives this one's input gradient, where [`Self::unit_stride`]: of the
    /// output gradient (N, O, output) with the kernel [`Self::flipped`], padded by
    /// `kernel - 1 - pad` on each side, its output the input's size. One matrix product of depth
    /// O kd kh kw instead of one of depth O (the column matrix's gradient) and a scatter back.
    fn transposed(&self) -> Conv3dShape {
        let pad = [0, 1, 2].map(|a| self.kernel[a] - 1 - self.pad[a]);
        Conv3dShape {
            c: self.o,
            o: self.c,
            input: self.output,
            output: self.input,
            stride: [1; 3],
            pad,
            ..*self
        }
    }

    /// The convolution of x (N, C, input) with w (O, C, kd, kh, kw), or with `flip` with the
    /// kernel of the convolution whose input gradient this is ([`Self::kernel`]): (N, O, output),
    /// as one tensor per part of the output channels, `parts` of them (O in all). Pointwise, a
    /// product per sample straight into the output; else per block, its operand matrix built in
    /// one workspace and multiplied by each part's rows of the kernel: a block of one sample's
    /// voxels straight into the output, a block of several samples into a second workspace,
    /// copied out sample by sample.
    fn convolve<T: Elem>(&self, x: Input<T>, w: &[T], flip: bool, parts: &[usize]) -> Vec<Vec<T>> {
        let (cols, rows) = (self.cols(), self.rows());
        let ranges = self.part_ranges(parts);
        // SAFETY: every output element is written by exactly one product or copy below.
        let mut ys: Vec<Vec<T>> =
            ranges.iter().map(|r| unsafe { uninit(self.n * r.len() * cols) }).collect();
        let joined = self.joined(x);
        let x = joined.as_deref().map_or(x, |x| Input::whole(x, self.c));
        if self.pointwise() {
            self.convolve_pointwise(x, w, flip, &ranges, &mut ys);
            return ys;
        }
        let wk = self.kernel(w, flip);
        let blocks = self.blocks();
        let widest = self.widest(&blocks);
        // SAFETY: `operand` writes the part of `buf` a block reads; a product writes the part of
        // `out` that is copied out.
        let (mut buf, mut out) = unsafe {
            (
                uninit(widest * rows),
                uninit(if blocks.iter().any(|b| b.samples.len() > 1) {
                    widest * self.o
                } else {
                    0
                }),
            )
        };
        let mut xc = ChannelsLast::new();
        for b in &blocks {
            let (start, len) = (self.block_start(b), self.block_len(b));
            let width = b.samples.len() * len;
            self.operand(x, &mut xc, b, &mut buf);
            let m = self.matrix(&buf[..width * rows]);
            for (y, r) in ys.iter_mut().zip(&ranges) {
                let (o, wk) = (r.len(), &wk[r.start * rows..r.end * rows]);
                // (o, width) = wk (o, rows) @ m^T: the product written transposed, as (width, o)
                // = m (width, rows) @ wk^T, where the patch matrix is the long row-major operand.
                let product =
                    |dst: &mut [T], strides: (usize, usize), width: usize| match self.layout() {
                        Layout::Patches => matmul_strided(
                            dst,
                            (strides.1, strides.0),
                            m,
                            mat(wk, true),
                            (width, rows, o),
                            false,
                        ),
                        Layout::Columns => matmul_strided(
                            dst,
                            strides,
                            mat(wk, false),
                            m.transposed(),
                            (o, rows, width),
                            false,
                        ),
                    };
                if b.samples.len() == 1 {
                    // (o, len) of (o, DHW)
                    product(&mut y[b.samples.start * o * cols + start..], (cols, 1), len);
                    continue;
                }
                product(&mut out, (width, 1), width); // (o, samples x len)
                scatter(&out[..o * width], (o, cols), start..start + len, b.samples.clone(), y);
            }
        }
        ys
    }

    /// The convolution of x with w (O, C, kd, kh, kw), or with `flip` the kernel of the
    /// convolution whose input gradient this is ([`Self::kernel`]), as [`Self::convolve`] gives
    /// it: directly where the direct kernels take it (f32, `direct::Plan::of`), else by
    /// [`Self::convolve`].
    fn convolve_any<T: Elem>(
        &self,
        x: Input<T>,
        w: &[T],
        flip: bool,
        parts: &[usize],
    ) -> Vec<Vec<T>> {
        if let Some(sub) = self.subsampled() {
            return sub.convolve_any(Input::whole(&self.subsample(x), self.c), w, flip, parts);
        }
        self.convolve_directly(x, w, flip, parts)
            .unwrap_or_else(|| self.convolve(x, w, flip, parts))
    }

    fn convolve_directly<T: Elem>(
        &self,
        x: Input<T>,
        w: &[T],
        flip: bool,
        parts: &[usize],
    ) -> Option<Vec<Vec<T>>> {
        let plan = direct::Plan::of(self)?;
        let x = Input { first: T::f32s(x.first)?, second: T::f32s(x.second)?, split: x.split };
        let ys = direct::convolve(self, plan, x, T::f32s(w)?, flip, &self.part_ranges(parts));
        ys.into_iter().map(T::from_f32s).collect()
    }

    /// The weight gradient (O, C, kd, kh, kw) from the output gradient gy, directly where the
    /// direct kernels take it (f32, `direct::WeightPlan::of`).
    fn weight_gradient_directly<T: Elem>(&self, x: Input<T>, gy: &[T]) -> Option<Vec<T>> {
        let plan = direct::WeightPlan::of(self)?;
        let x = Input { first: T::f32s(x.first)?, second: T::f32s(x.second)?, split: x.split };
        T::from_f32s(direct::weight_gradient(self, plan, x, T::f32s(gy)?))
    }

    /// The output channels of each of `parts`, in order: O in all.
    fn part_ranges(&self, parts: &[usize]) -> Vec<Range<usize>> {
        let mut at = 0;
        let ranges: Vec<Range<usize>> = parts
            .iter()
            .map(|&p| {
                at += p;
                at - p..at
            })
            .collect();
        assert_eq!(
            ranges.last().map(|r| r.end),
            Some(self.o),
            "conv3d: output parts {parts:?} do not make {} channels",
            self.o
        );
        ranges
    }

    /// Output channels `r` of a pointwise kernel, an (r.len(), C) operand: rows of w (O, C), or
    /// with `flip` columns of the kernel w (C, O) of the convolution whose input gradient this
    /// is, read in place as its transpose (copied, it took a third of ResNet's last pointwise
    /// input gradients).
    fn pointwise_rows<'w, T>(&self, w: &'w [T], flip: bool, r: &Range<usize>) -> super::Mat<'w, T> {
        match flip {
            true => mat(&w[r.start..], true).ld(self.o),
            false => mat(&w[r.start * self.c..r.end * self.c], false),
        }
    }

    /// [`Self::convolve`] of a pointwise convolution: a product per sample straight into each
    /// part of the output, `ys`, whose channels `ranges` gives.
    fn convolve_pointwise<T: Elem>(
        &self,
        x: Input<T>,
        w: &[T],
        flip: bool,
        ranges: &[Range<usize>],
        ys: &mut [Vec<T>],
    ) {
        let cols = self.cols();
        if cols < FEW_VOXELS / 4 {
            return self.convolve_pointwise_gathered(x, w, flip, ranges, ys);
        }
        for (y, r) in ys.iter_mut().zip(ranges) {
            let o = r.len();
            // A product per sample, the samples side by side: split over the threads, each
            // product (a 64 x 64 kernel by 1024 voxels in ResNet's first stage) spent as long
            // waiting for the other thread as multiplying.
            let xs = x.first.par_chunks(self.c * cols);
            y.par_chunks_mut(o * cols).zip(xs).for_each(|(y_n, x_n)| {
                // (o, DHW) = the kernel's rows (o, C) @ x_n (C, DHW)
                let wk = self.pointwise_rows(w, flip, r);
                matmul_alone(y_n, wk, mat(x_n, false), (o, self.c, cols), false);
            });
        }
    }

    /// [`Self::convolve_pointwise`] of few voxels per sample: runs of samples gathered side by
    /// side, (C, samples x DHW), one product each (a product per sample packed the whole kernel
    /// again for 16 voxels in ResNet's last stage).
    fn convolve_pointwise_gathered<T: Elem>(
        &self,
        x: Input<T>,
        w: &[T],
        flip: bool,
        ranges: &[Range<usize>],
        ys: &mut [Vec<T>],
    ) {
        let cols = self.cols();
        let run = self.samples_per_run(self.c + self.o);
        // SAFETY: the gathers and the product write what is read of each.
        let (mut xs, mut out) =
            unsafe { (uninit(self.c * run * cols), uninit(self.o * run * cols)) };
        for n0 in (0..self.n).step_by(run) {
            let samples = n0..(n0 + run).min(self.n);
            let width = samples.len() * cols;
            gather(x.first, (self.c, cols), 0..cols, samples.clone(), &mut xs);
            for (y, r) in ys.iter_mut().zip(ranges) {
                let (o, out) = (r.len(), &mut out[..r.len() * width]);
                let wk = self.pointwise_rows(w, flip, r);
                // (o, samples x DHW) = the kernel's rows (o, C) @ xs (C, samples x DHW)
                matmul(out, wk, mat(&xs[..self.c * width], false), (o, self.c, width), false);
                scatter(out, (o, cols), 0..cols, samples.clone(), y);
            }
        }
    }

    /// Samples whose `channels` x DHW entries fit a block together, at least one.
    fn samples_per_run(&self, channels: usize) -> usize {
        (self.block_entries / (channels * self.cols()).max(1)).min(self.n).max(1)
    }

    /// A pointwise convolution's dW (O, C) += the sum over samples of gy_n (O, DHW) @ x_n^T. A
    /// product per sample leaves its small output (64 x 64 in ResNet's first stage) to one thread
    /// (3-4x oneDNN's time): of few voxels, the samples are gathered side by side in runs that fit
    /// a block, a product of depth samples x DHW per run, the runs in order; else a fixed number
    /// of runs of samples are summed side by side, a product per sample, and their sums added
    /// in order. Either way the sums' order does not depend on the threads.
    fn pointwise_weight_gradient<T: Elem>(&self, x: &[T], gy: &[T]) -> Vec<T> {
        const RUNS: usize = 4;
        let cols = self.cols();
        if cols >= FEW_VOXELS {
            return sum_chunks(self.n, self.n.div_ceil(RUNS), self.o * self.c, |n, sum| {
                let g_n = mat(&gy[n * self.o * cols..][..self.o * cols], false);
                let x_n = mat(&x[n * self.c * cols..][..self.c * cols], true);
                // (O, C) += g_n (O, DHW) @ x_n^T
                matmul_alone(sum, g_n, x_n, (self.o, cols, self.c), true);
            });
        }
        let run = self.samples_per_run(self.c + self.o);
        // SAFETY: the gathers write what the product reads, the first product all of dw.
        let (mut dw, mut gs, mut xs) = unsafe {
            (
                sums(self.o * self.c, self.n),
                uninit(self.o * run * cols),
                uninit(self.c * run * cols),
            )
        };
        for n0 in (0..self.n).step_by(run) {
            let samples = n0..(n0 + run).min(self.n);
            let width = samples.len() * cols;
            gather(gy, (self.o, cols), 0..cols, samples.clone(), &mut gs);
            gather(x, (self.c, cols), 0..cols, samples, &mut xs);
            let (g, x) = (mat(&gs[..self.o * width], false), mat(&xs[..self.c * width], true));
            matmul(&mut dw, g, x, (self.o, width, self.c), n0 > 0);
        }
        dw
    }

    /// The output gradient's columns of block `b`, (O, samples x len): `gy` (N, O, output) itself
    /// where the block is one sample's, else gathered into the workspace `g`.
    fn block_gradient<'a, T: Elem>(
        &self,
        gy: &'a [T],
        b: &ConvBlock,
        g: &'a mut [T],
    ) -> super::Mat<'a, T> {
        let (cols, start, len) = (self.cols(), self.block_start(b), self.block_len(b));
        if b.samples.len() == 1 {
            return mat(&gy[b.samples.start * self.o * cols + start..], false).ld(cols);
        }
        gather(gy, (self.o, cols), start..start + len, b.samples.clone(), g);
        mat(&g[..self.o * b.samples.len() * len], false)
    }

    /// A block's operand matrix as the (samples x len, rows) matrix of [`Self::patches`]: the
    /// column matrix is its transpose.
    fn matrix<'a, T>(&self, buf: &'a [T]) -> super::Mat<'a, T> {
        mat(buf, self.layout() == Layout::Columns)
    }
}

/// Voxels per sample below which a pointwise convolution's weight gradient gathers samples side
/// by side for one product, rather than one product per sample (its forward below a quarter of
/// that: the kernel bench's best at ResNet's shapes).
const FEW_VOXELS: usize = 256;

/// Columns `part` of each channel of `samples` of src (N, channels, cols) side by side into the
/// front of `dst`: (channels, samples x part), a channel per task.
fn gather<T: Elem>(
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
fn scatter<T: Elem>(
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

/// How a block's operand matrix is stored: the column matrix (rows, voxels) or the patch matrix
/// (voxels, rows).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Layout {
    Columns,
    Patches,
}

/// The current block's input channels-last ([`Conv3dShape::channels_last`]), made again only when
/// a block reads samples or depth planes it does not hold (a sample's slices and rows come in a
/// run; blocks never hold no samples, so the empty start is never taken for one).
struct ChannelsLast<T> {
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
    fn new() -> Self {
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

/// A block of the column matrix: output rows `rows` of depth slices `zs` of samples `samples`,
/// side by side (`rows` is a part of the plane only in a block of one slice of one sample).
struct ConvBlock {
    samples: Range<usize>,
    zs: Range<usize>,
    rows: Range<usize>,
}

struct Conv3dOp {
    shape: Conv3dShape,
    /// The input comes as two tensors, the first with this many channels ([`conv3d_concat`]).
    split: Option<usize>,
}

impl Conv3dOp {
    /// The input's channels as its tensors hold them: one part, or two.
    fn parts(&self) -> Vec<usize> {
        match self.split {
            Some(split) => vec![split, self.shape.c - split],
            None => vec![self.shape.c],
        }
    }

    /// dW = sum over blocks of gy @ the block's operand matrix (pointwise: gy_n @ x_n^T summed
    /// over samples, in place); dx = the [`Conv3dShape::transposed`] convolution of gy where the
    /// stride is one, else per block col2vol(W^T @ gy). Blocks in order, so the sums are too. dx
    /// comes as one tensor per part of the input. `want`: whether dx and dW are wanted (an
    /// image with no variable upstream, a frozen weight): those not wanted are not computed,
    /// and come back empty.
    fn backward<T: Elem>(
        &self,
        x: Input<T>,
        w: &[T],
        gy: &[T],
        want: Want,
    ) -> Result<(Vec<Vec<T>>, Vec<T>)> {
        let s = &self.shape;
        let rows = s.rows();
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
            let dxs = sub.transposed().convolve_any(Input::whole(gy, s.o), w, true, &[s.c]);
            return Ok((self.split_by_parts(s.spread(&dxs[0])), dw));
        }
        let direct_dw = if want.dw { s.weight_gradient_directly(x, gy) } else { None };
        let looped_dw = want.dw && direct_dw.is_none();
        let transposed_dx = || {
            let t = s.transposed();
            if want.dx {
                t.convolve_any(Input::whole(gy, s.o), w, true, &self.parts())
            } else {
                Vec::new()
            }
        };
        if s.pointwise() {
            let dw = if looped_dw { s.pointwise_weight_gradient(x.first, gy) } else { Vec::new() };
            return Ok((transposed_dx(), direct_dw.unwrap_or(dw)));
        }
        let mut dw = if looped_dw { vec![T::zero(); w.len()] } else { Vec::new() };
        let strided = !s.unit_stride();
        let col2vol = strided && want.dx;
        if !(looped_dw || col2vol) {
            return Ok((transposed_dx(), direct_dw.unwrap_or(dw)));
        }
        let mut dx = if col2vol { vec![T::zero(); s.n * s.c * s.volume()] } else { Vec::new() };
        let blocks = s.blocks();
        let widest = s.widest(&blocks);
        let several = blocks.iter().any(|b| b.samples.len() > 1);
        // SAFETY: each block writes the part of each workspace it reads: `operand` writes `buf`,
        // the gather `g`, the product `dcol`. The operand matrix only for the weight gradient:
        // the input gradient's product reads the kernel and the output gradient.
        let (mut buf, mut g, mut dcol) = unsafe {
            (
                uninit(if looped_dw { widest * rows } else { 0 }),
                uninit(if several { s.o * widest } else { 0 }),
                uninit(if col2vol { rows * widest } else { 0 }),
            )
        };
        let mut xc = ChannelsLast::new();
        for b in &blocks {
            let len = s.block_len(b);
            let width = b.samples.len() * len;
            let gb = s.block_gradient(gy, b, &mut g);
            if looped_dw {
                s.operand(x, &mut xc, b, &mut buf);
                matmul(&mut dw, gb, s.matrix(&buf[..width * rows]), (s.o, width, rows), true);
                // += (O, rows) in the layout's order
            }
            if col2vol {
                // (rows, samples x len)
                matmul(&mut dcol[..rows * width], mat(w, true), gb, (rows, s.o, width), false);
                s.col2vol(&dcol, b, &mut dx);
            }
        }
        drop((buf, g, dcol, xc)); // before the input gradient's convolution makes its own
        let dw = match direct_dw {
            Some(dw) => dw,
            None if looped_dw => s.natural(dw),
            None => dw,
        };
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

/// The gradients a backward is asked for: those of operands some variable leads to.
#[derive(Clone, Copy)]
struct Want {
    dx: bool,
    dw: bool,
}

impl FusedOp for Conv3dOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let s = &self.shape;
        let ((x, xl), (w, wl)) = (inputs[0], inputs[inputs.len() - 1]);
        let y = per_float!(x, "conv3d", {
            let w = slice(w, wl)?;
            let first = slice(x, xl)?;
            let second = inputs
                .get(1)
                .filter(|_| inputs.len() == 3)
                .map(|&(b, bl)| slice(b, bl))
                .transpose()?;
            let input = Input {
                first: &first,
                second: second.as_deref().unwrap_or(&[]),
                split: self.split.unwrap_or(s.c),
            };
            s.convolve_any(input, &w, false, &[s.o]).remove(0)
        });
        Ok((y, Shape::from(vec![s.n, s.o, s.output[0], s.output[1], s.output[2]])))
    }

    fn bwd(&self, inputs: &[&Tensor], _y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let (x, w) = (inputs[0], inputs[inputs.len() - 1]);
        let second = (inputs.len() == 3).then(|| inputs[1]);
        let g = g.contiguous()?;
        let parts = &inputs[..inputs.len() - 1];
        let want = Want { dx: parts.iter().any(|x| x.track_op()), dw: w.track_op() };
        let (dxs, dw) = per_dtype!(x.dtype(), T => {
            let split = self.split.unwrap_or(self.shape.c);
            let (dxs, dw) = with_slice::<T, _>(x, |xs| {
                let run = |bs: &[T]| {
                    with_slice(w, |ws| {
                        with_slice(&g, |gs| {
                            self.backward(Input { first: xs, second: bs, split }, ws, gs, want)
                        })
                    })
                };
                match second {
                    Some(b) => with_slice(b, run),
                    None => run(&[]),
                }
            })?;
            // Not wanted, dx was not computed: no gradient for any part.
            let dxs = match want.dx {
                true => dxs
                    .into_iter()
                    .zip(parts)
                    .map(|(dx, x)| x.track_op().then(|| shaped(dx, x)).transpose())
                    .collect::<Result<Vec<_>>>()?,
                false => vec![None; parts.len()],
            };
            (dxs, want.dw.then(|| shaped(dw, w)).transpose()?)
        });
        Ok(dxs.into_iter().chain([dw]).collect())
    }
}

custom_op!(Conv3dOp: 2 "fused-conv3d", 3 "fused-conv3d-concat");
custom_op!(Replay<Conv3dOp>: 2 "replayed-conv3d", 3 "replayed-conv3d-concat");
