//! The 1x1x1 kernels, which build no operand matrix: a pointwise one (unit stride, no padding)
//! is a matrix product per sample, or of few voxels per run of samples gathered side by side; a
//! strided one (ResNet's downsampling shortcuts) is the pointwise convolution of the voxels it
//! reads, and its input gradient that convolution's spread back. Not here: the blocks' path of
//! every other kernel (`convolve`, `backward`).

use super::blocks::{gather, scatter};
use super::input::Input;
use super::shape::Conv3dShape;
use super::Kernel;
use crate::fused::elem::Elem;
use crate::fused::matmul::{mat, matmul, matmul_alone, Dest, Mat};
use crate::fused::parallel::sum_chunks;
use crate::fused::uninit::{sums, uninit};
use rayon::prelude::*;
use std::ops::Range;

impl Conv3dShape {
    /// A kernel of one voxel, unit stride, no padding: the column matrix of a sample is the
    /// sample itself, so the convolution is one matrix product per sample and builds nothing.
    pub(super) fn pointwise(&self) -> bool {
        self.kernel == [1; 3] && self.stride == [1; 3] && self.pad == [0; 3]
    }

    /// Where this is a strided 1x1x1 kernel without padding (ResNet's downsampling shortcuts):
    /// the pointwise convolution of the voxels it reads, every stride-th, which [`Self::subsample`]
    /// gathers (through the operand matrix, a patch per voxel, it took 2x oneDNN's time).
    pub(super) fn subsampled(&self) -> Option<Conv3dShape> {
        let strided = self.kernel == [1; 3] && self.pad == [0; 3] && self.stride != [1; 3];
        strided.then_some(Conv3dShape { input: self.output, stride: [1; 3], ..*self })
    }

    /// The voxels of x (N, C, input) that a strided 1x1x1 kernel reads: (N, C, output).
    pub(super) fn subsample<T: Elem>(&self, x: Input<T>) -> Vec<T> {
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
    pub(super) fn spread<T: Elem>(&self, dxs: &[T]) -> Vec<T> {
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

    /// Output channels `r` of a pointwise kernel, an (r.len(), C) operand: rows of w (O, C), or
    /// with [`Kernel::Flipped`] columns of the kernel w (C, O) of the convolution whose input
    /// gradient this is, read in place as its transpose (copied, it took a third of ResNet's last
    /// pointwise input gradients).
    fn pointwise_rows<'w, T>(&self, w: &'w [T], kernel: Kernel, r: &Range<usize>) -> Mat<'w, T> {
        match kernel {
            Kernel::Flipped => mat(&w[r.start..]).transposed().ld(self.o),
            Kernel::AsIs => mat(&w[r.start * self.c..r.end * self.c]),
        }
    }

    /// [`Self::convolve`] of a pointwise convolution: a product per sample straight into each
    /// part of the output, `ys`, whose channels `ranges` gives.
    pub(super) fn convolve_pointwise<T: Elem>(
        &self,
        x: Input<T>,
        w: &[T],
        kernel: Kernel,
        ranges: &[Range<usize>],
        ys: &mut [Vec<T>],
    ) {
        let cols = self.cols();
        if cols < FEW_VOXELS / 4 {
            return self.convolve_pointwise_gathered(x, w, kernel, ranges, ys);
        }
        for (y, r) in ys.iter_mut().zip(ranges) {
            let o = r.len();
            // A product per sample, the samples side by side: split over the threads, each
            // product (a 64 x 64 kernel by 1024 voxels in ResNet's first stage) spent as long
            // waiting for the other thread as multiplying.
            let xs = x.first.par_chunks(self.c * cols);
            y.par_chunks_mut(o * cols).zip(xs).for_each(|(y_n, x_n)| {
                // (o, DHW) = the kernel's rows (o, C) @ x_n (C, DHW)
                let wk = self.pointwise_rows(w, kernel, r);
                matmul_alone(y_n, wk, mat(x_n), (o, self.c, cols), Dest::Overwrite);
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
        kernel: Kernel,
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
                let wk = self.pointwise_rows(w, kernel, r);
                // (o, samples x DHW) = the kernel's rows (o, C) @ xs (C, samples x DHW)
                let xs = mat(&xs[..self.c * width]);
                matmul(out, wk, xs, (o, self.c, width), Dest::Overwrite);
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
    pub(super) fn pointwise_weight_gradient<T: Elem>(&self, x: &[T], gy: &[T]) -> Vec<T> {
        const RUNS: usize = 4;
        let cols = self.cols();
        if cols >= FEW_VOXELS {
            return sum_chunks(self.n, self.n.div_ceil(RUNS), self.o * self.c, |n, sum| {
                let g_n = mat(&gy[n * self.o * cols..][..self.o * cols]);
                let x_n = mat(&x[n * self.c * cols..][..self.c * cols]).transposed();
                // (O, C) += g_n (O, DHW) @ x_n^T
                matmul_alone(sum, g_n, x_n, (self.o, cols, self.c), Dest::Accumulate);
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
            let (g, x) = (mat(&gs[..self.o * width]), mat(&xs[..self.c * width]).transposed());
            let dest = if n0 > 0 { Dest::Accumulate } else { Dest::Overwrite };
            matmul(&mut dw, g, x, (self.o, width, self.c), dest);
        }
        dw
    }
}

/// Voxels per sample below which a pointwise convolution's weight gradient gathers samples side
/// by side for one product, rather than one product per sample (its forward below a quarter of
/// that: the kernel bench's best at ResNet's shapes).
const FEW_VOXELS: usize = 256;
