//! The sizes of one 3D convolution: [`Conv3dGeometry`], the strides and padding a caller gives,
//! and `Conv3dShape`, every size of the problem (batch, channels, input, kernel, output) and the
//! workspace size of its blocks; with the convolution that gives its input gradient
//! ([`Conv3dShape::transposed`]). Not here: the blocks (`blocks`), the 1x1x1 kernels' shapes
//! (`pointwise`).

use candle_core::Result;
use std::ops::Range;

/// Geometry of a 3D convolution: stride and padding in depth, and in-plane (height and width share
/// them, as candle's `conv2d` takes one stride and one padding).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv3dGeometry {
    pub stride_d: usize,
    pub stride_hw: usize,
    pub pad_d: usize,
    pub pad_hw: usize,
}

impl Conv3dGeometry {
    /// Stride 1, "same" padding for an odd cubic kernel `k`.
    pub fn same(k: usize) -> Self {
        Conv3dGeometry { stride_d: 1, stride_hw: 1, pad_d: k / 2, pad_hw: k / 2 }
    }
}

/// The sizes of one 3D convolution.
#[derive(Clone, Copy, Debug)]
pub(super) struct Conv3dShape {
    pub(super) n: usize,
    pub(super) c: usize,
    pub(super) o: usize,
    pub(super) input: [usize; 3],
    pub(super) kernel: [usize; 3],
    pub(super) stride: [usize; 3],
    pub(super) pad: [usize; 3],
    pub(super) output: [usize; 3],
    pub(super) block_entries: usize,
}

impl Conv3dShape {
    pub(super) fn new(
        (n, c, d, h, w): (usize, usize, usize, usize, usize),
        (o, c_w, kd, kh, kw): (usize, usize, usize, usize, usize),
        g: Conv3dGeometry,
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
    pub(super) fn sized(self) -> Self {
        let largest = (self.n * self.c * self.volume())
            .max(self.n * self.o * self.cols())
            .max(self.o * self.rows());
        Conv3dShape { block_entries: self.block_entries.min(2 * largest), ..self }
    }

    /// Rows of the column matrix (C kd kh kw) and its columns (output voxels).
    pub(super) fn rows(&self) -> usize {
        self.c * self.kernel.iter().product::<usize>()
    }

    pub(super) fn cols(&self) -> usize {
        self.output.iter().product()
    }

    pub(super) fn volume(&self) -> usize {
        self.input.iter().product()
    }

    /// For row r = (c, a, p, q) of the column matrix and output coordinate `out` along axis
    /// `axis`, the input coordinate it reads, if inside the input.
    pub(super) fn source(&self, axis: usize, out: usize, k: usize) -> Option<usize> {
        (out * self.stride[axis] + k).checked_sub(self.pad[axis]).filter(|&v| v < self.input[axis])
    }

    /// Unit stride, each padding smaller than its kernel side: the input gradient is then itself
    /// a convolution ([`Self::transposed`]).
    pub(super) fn unit_stride(&self) -> bool {
        self.stride == [1; 3] && (0..3).all(|a| self.pad[a] < self.kernel[a])
    }

    /// The convolution that gives this one's input gradient, where [`Self::unit_stride`]: of the
    /// output gradient (N, O, output) with the kernel [`Self::flipped`], padded by
    /// `kernel - 1 - pad` on each side, its output the input's size. One matrix product of depth
    /// O kd kh kw instead of one of depth O (the column matrix's gradient) and a scatter back.
    pub(super) fn transposed(&self) -> Conv3dShape {
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

    /// The output channels of each of `parts`, in order: O in all.
    pub(super) fn part_ranges(&self, parts: &[usize]) -> Vec<Range<usize>> {
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
}
