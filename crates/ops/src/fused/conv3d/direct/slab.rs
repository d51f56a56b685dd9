//! The zero-padded input planes a block of direct convolution reads ([`SlabShape`]): a copy of a
//! few depth planes at a time, so that a tap is one fixed offset for every position and no border
//! needs a test; and the blocks of the work that each read one slab ([`Block`]). Not here: the
//! kernels that read it (`forward`, `weight_gradient`).

use crate::fused::conv3d::input::Input;
use crate::fused::conv3d::shape::Conv3dShape;
use crate::fused::uninit::uninit;
use rayon::prelude::*;
use std::ops::Range;

/// A block of the work: output depth slices `zs` of samples `samples`, read from one slab.
pub(super) struct Block {
    pub(super) samples: Range<usize>,
    pub(super) zs: Range<usize>,
}

/// The zero-padded input planes a block reads: (samples, C, planes, H + 2 pad, `width`), the rows
/// wide enough that every column tile, the last one's included, reads inside its own row.
pub(super) struct SlabShape {
    pub(super) rows: usize,
    pub(super) width: usize,
    /// Output depth slices per slab, and samples where a slab holds whole ones.
    slices: usize,
    samples: usize,
}

impl SlabShape {
    /// The slab for column tiles `cols` wide, within the workspace size the blocks of the matrix
    /// products have: whole samples while they fit, else runs of a sample's depth slices. Where a
    /// block also holds `voxel` entries per output voxel (the weight gradient's output gradient,
    /// which every task reads through), those stay within a quarter of it, so that they stay in
    /// the cache the tasks share (at the whole batch, the ResNet stem's weight gradient read 8 MiB
    /// per task: 2.6x oneDNN's time).
    pub(super) fn new(s: &Conv3dShape, cols: usize, voxel: usize) -> SlabShape {
        let ([kd, _, kw], [sd, _, sw]) = (s.kernel, s.stride);
        let rows = s.input[1] + 2 * s.pad[1];
        let tiles = s.output[2].div_ceil(cols);
        let width = (s.input[2] + 2 * s.pad[2]).max((tiles * cols - 1) * sw + kw);
        let plane = s.c * rows * width;
        // Blocks of `n` slices that hold the voxels' entries within the quarter.
        let plane_out = s.output[1] * s.output[2];
        let held = |n: usize| match voxel {
            0 => usize::MAX,
            v => (s.block_entries / 4 / (n * plane_out * v)).max(1),
        };
        let planes = (s.block_entries / plane.max(1)).max(kd);
        let slices = ((planes - kd) / sd + 1).min(held(1)).min(s.output[0]);
        let sample = plane * ((s.output[0] - 1) * sd + kd);
        let samples = match slices == s.output[0] {
            true => (s.block_entries / sample).min(held(s.output[0])).max(1),
            false => 1,
        };
        SlabShape { rows, width, slices, samples }
    }

    /// The blocks of convolution `s`, in order: runs of samples, each in runs of depth slices.
    pub(super) fn blocks(&self, s: &Conv3dShape) -> Vec<Block> {
        let (depth, n) = (s.output[0], s.n);
        (0..n)
            .step_by(self.samples)
            .flat_map(|k| {
                let samples = k..(k + self.samples).min(n);
                (0..depth).step_by(self.slices).map(move |z| Block {
                    samples: samples.clone(),
                    zs: z..(z + self.slices).min(depth),
                })
            })
            .collect()
    }

    /// Elements of one channel of a block's planes.
    fn planes_len(&self, s: &Conv3dShape, b: &Block) -> usize {
        ((b.zs.len() - 1) * s.stride[0] + s.kernel[0]) * self.rows * self.width
    }

    /// Elements from one channel of a block's slab to the next: its planes, rounded up to an odd
    /// number of cache lines. A tile reads the same place of every channel; a power-of-two stride
    /// between them (32x32 planes) puts all those reads in a few sets of the cache, which then
    /// evicts them (the up-convolution's input gradient ran at a quarter of its speed).
    pub(super) fn channel(&self, s: &Conv3dShape, b: &Block) -> usize {
        const LINE: usize = 16;
        let lines = self.planes_len(s, b).div_ceil(LINE);
        (lines | 1) * LINE
    }

    /// The slab of block `b`, a channel of a sample per task.
    pub(super) fn fill(&self, s: &Conv3dShape, x: Input<f32>, b: &Block) -> Vec<f32> {
        let ([d, h, w], [pd, ph, pw]) = (s.input, s.pad);
        let channel = self.channel(s, b);
        // SAFETY: every row of every plane of every channel is written below.
        let mut slab = unsafe { uninit(b.samples.len() * s.c * channel) };
        slab.par_chunks_mut(channel).enumerate().for_each(|(task, dst)| {
            let (n, ch) = (b.samples.start + task / s.c, task % s.c);
            let src = x.channel(n, ch, s.c, s.volume());
            let planes = &mut dst[..self.planes_len(s, b)];
            for (p, plane) in planes.chunks_mut(self.rows * self.width).enumerate() {
                let z = (b.zs.start * s.stride[0] + p).checked_sub(pd).filter(|&z| z < d);
                for (r, row) in plane.chunks_mut(self.width).enumerate() {
                    let (Some(z), Some(y)) = (z, r.checked_sub(ph).filter(|&y| y < h)) else {
                        row.fill(0.0);
                        continue;
                    };
                    row[..pw].fill(0.0);
                    row[pw..pw + w].copy_from_slice(&src[(z * h + y) * w..][..w]);
                    row[pw + w..].fill(0.0);
                }
            }
        });
        slab
    }

    /// Each tap's offset in a channel of the slab, taps in (kd, kh, kw) order.
    pub(super) fn taps(&self, s: &Conv3dShape) -> Vec<usize> {
        let [kd, kh, kw] = s.kernel;
        (0..kd * kh * kw)
            .map(|k| ((k / (kh * kw) * self.rows) + (k / kw) % kh) * self.width + k % kw)
            .collect()
    }

    /// Each output line (sample, slice, row) of block `b`: where its first voxel reads its first
    /// tap in the slab, and that voxel's index among the block's.
    pub(super) fn lines(&self, s: &Conv3dShape, b: &Block) -> Vec<(usize, usize)> {
        let ([_, oh, ow], sample) = (s.output, s.c * self.channel(s, b));
        let (zl, n) = (b.zs.len(), b.samples.len());
        (0..n * zl * oh)
            .map(|i| {
                let (k, z, y) = (i / (zl * oh), (i / oh) % zl, i % oh);
                (k * sample + self.at(s, z, y, 0), i * ow)
            })
            .collect()
    }

    /// Where output voxel (z, y, x) of a block's sample reads its first tap, from the sample's
    /// start in the slab.
    pub(super) fn at(&self, s: &Conv3dShape, z: usize, y: usize, x: usize) -> usize {
        (z * s.stride[0] * self.rows + y * s.stride[1]) * self.width + x * s.stride[2]
    }
}
