//! A convolution's output, or with the flipped kernel an input gradient: directly where the
//! direct kernels take it (f32 on AVX2 or AVX-512: `direct`), a 1x1x1 kernel by a product per
//! sample (`pointwise`), else per block of the operand matrix, multiplied by the kernel's rows
//! for each part of the output channels. Not here: the weight gradient (`backward`).

use super::blocks::scatter;
use super::input::Input;
use super::layout::Layout;
use super::operand_matrix::ChannelsLast;
use super::shape::Conv3dShape;
use super::{direct, Kernel};
use crate::fused::elem::Elem;
use crate::fused::matmul::{mat, matmul_strided, Dest};
use crate::fused::uninit::uninit;

impl Conv3dShape {
    /// The convolution of x (N, C, input) with w (O, C, kd, kh, kw), or with [`Kernel::Flipped`]
    /// with the kernel of the convolution whose input gradient this is ([`Self::kernel`]): (N, O,
    /// output),
    /// as one tensor per part of the output channels, `parts` of them (O in all). Pointwise, a
    /// product per sample straight into the output; else per block, its operand matrix built in
    /// one workspace and multiplied by each part's rows of the kernel: a block of one sample's
    /// voxels straight into the output, a block of several samples into a second workspace,
    /// copied out sample by sample.
    pub(super) fn convolve<T: Elem>(
        &self,
        x: Input<T>,
        w: &[T],
        kernel: Kernel,
        parts: &[usize],
    ) -> Vec<Vec<T>> {
        let (cols, rows) = (self.cols(), self.rows());
        let ranges = self.part_ranges(parts);
        // SAFETY: every output element is written by exactly one product or copy below.
        let mut ys: Vec<Vec<T>> =
            ranges.iter().map(|r| unsafe { uninit(self.n * r.len() * cols) }).collect();
        let joined = self.joined(x);
        let x = joined.as_deref().map_or(x, |x| Input::whole(x, self.c));
        if self.pointwise() {
            self.convolve_pointwise(x, w, kernel, &ranges, &mut ys);
            return ys;
        }
        let wk = self.kernel(w, kernel);
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
                            mat(wk).transposed(),
                            (width, rows, o),
                            Dest::Overwrite,
                        ),
                        Layout::Columns => matmul_strided(
                            dst,
                            strides,
                            mat(wk),
                            m.transposed(),
                            (o, rows, width),
                            Dest::Overwrite,
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

    /// The convolution of x with w (O, C, kd, kh, kw), or with [`Kernel::Flipped`] the kernel of
    /// the convolution whose input gradient this is ([`Self::kernel`]), as [`Self::convolve`]
    /// gives it: directly where the direct kernels take it (f32, `direct::Plan::of`), else by
    /// [`Self::convolve`]. A strided 1x1x1 kernel is the pointwise convolution of the voxels it
    /// reads ([`Self::subsampled`]).
    pub(super) fn convolve_any<T: Elem>(
        &self,
        x: Input<T>,
        w: &[T],
        kernel: Kernel,
        parts: &[usize],
    ) -> Vec<Vec<T>> {
        if let Some(sub) = self.subsampled() {
            return sub.convolve_any(Input::whole(&self.subsample(x), self.c), w, kernel, parts);
        }
        self.convolve_directly(x, w, kernel, parts)
            .unwrap_or_else(|| self.convolve(x, w, kernel, parts))
    }

    fn convolve_directly<T: Elem>(
        &self,
        x: Input<T>,
        w: &[T],
        kernel: Kernel,
        parts: &[usize],
    ) -> Option<Vec<Vec<T>>> {
        let plan = direct::Plan::of(self)?;
        let x = Input { first: T::f32s(x.first)?, second: T::f32s(x.second)?, split: x.split };
        let ys = direct::convolve(self, plan, x, T::f32s(w)?, kernel, &self.part_ranges(parts));
        ys.into_iter().map(T::from_f32s).collect()
    }
}
