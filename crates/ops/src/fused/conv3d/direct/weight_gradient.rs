//! The direct weight gradient: for each output-channel tile and run of kernel rows, a task sums
//! over a block's voxels the output gradient times the input each tap read, in vector registers,
//! the blocks in order (each sum in one fixed order); the output gradient transposed so that a
//! voxel's channels lie side by side. Not here: the sums' kernel itself (`simd`).

use super::plan::WeightPlan;
use super::slab::{Block, SlabShape};
use crate::fused::conv3d::input::Input;
use crate::fused::conv3d::shape::Conv3dShape;
use crate::fused::uninit::{sums, uninit};
use rayon::prelude::*;

/// The weight gradient (O, C, taps) of convolution `s` of x from its output gradient gy (N, O,
/// output): for each output channel, tap and input channel, the sum over every output voxel of
/// gy times the input it read. A task per output-channel tile and run of kernel rows, its sums
/// in registers over a block's voxels, the blocks in order: each sum in one fixed order.
pub(crate) fn weight_gradient(
    s: &Conv3dShape,
    plan: WeightPlan,
    x: Input<f32>,
    gy: &[f32],
) -> Vec<f32> {
    let (t, kw) = (plan.channels(), s.kernel[2]);
    let (tiles_o, taps, rows) = (s.o.div_ceil(t), s.rows() / s.c, s.c * s.kernel[0] * s.kernel[1]);
    let slab = SlabShape::new(s, 1, tiles_o * t);
    let runs = rows.div_ceil(plan.groups);
    // Where that leaves few tasks (the U-Net's first convolution, of one input channel, has 3),
    // each block's lines are split into parts, each part's sums kept apart and the parts added
    // in order at the end: the split is fixed by the shapes, so the bits do not depend on the
    // threads.
    let parts = MIN_TASKS.div_ceil(tiles_o * runs);
    let size = tiles_o * s.c * taps * t;
    let blocks = slab.blocks(s);
    // SAFETY: the first block's tasks write every entry (each part's tiles x rows x kw x T).
    let mut packed = unsafe { sums(parts * size, blocks.len()) };
    for (i, block) in blocks.into_iter().enumerate() {
        let data = slab.fill(s, x, &block);
        let (lines, gyt) = (slab.lines(s, &block), transposed(s, t, gy, &block));
        let channel = slab.channel(s, &block);
        let sums = Shared(packed.as_mut_ptr());
        (0..tiles_o * runs * parts).into_par_iter().for_each(|task| {
            let (part, task) = (task % parts, task / parts);
            let (tile, first) = (task / runs, (task % runs) * plan.groups);
            let groups = plan.groups.min(rows - first);
            let mut args = GradArgs {
                x: data.as_ptr(),
                groups: [0; 8],
                gy: gyt[tile * t..].as_ptr(),
                ld: tiles_o * t,
                dw: [std::ptr::null_mut(); 8],
                fresh: i == 0,
                lines: &lines[part * lines.len() / parts..(part + 1) * lines.len() / parts],
                ow: s.output[2],
            };
            for (g, row) in (first..first + groups).enumerate() {
                let (c, a, b) =
                    (row / (rows / s.c), (row / s.kernel[1]) % s.kernel[0], row % s.kernel[1]);
                args.groups[g] = c * channel + (a * slab.rows + b) * slab.width;
                args.dw[g] = sums.at(part * size + (tile * s.c * taps + row * kw) * t);
            }
            // SAFETY: the slab holds every element a line's taps read, `gyt` a T-wide run of
            // every voxel, and this task alone adds into its part's rows' taps of its tile.
            unsafe { grad_fn(plan, kw, groups, s.stride[2])(&args) };
        });
    }
    let (sum, rest) = packed.split_at_mut(size);
    for part in rest.chunks_exact(size) {
        sum.iter_mut().zip(part).for_each(|(a, &b)| *a += b);
    }
    unpack(s, t, sum)
}

/// Tasks a weight gradient's block is split into at least: a few per thread.
const MIN_TASKS: usize = 8;

/// A pointer the tasks share, each writing its own elements.
struct Shared(*mut f32);

// SAFETY: the tasks write disjoint elements and nothing reads them until every task is done.
unsafe impl Sync for Shared {}

impl Shared {
    /// The element `i` places on (a method, so that a closure captures the whole `Shared`).
    fn at(&self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// Packed (O / T, C, taps, T) back as w (O, C, taps) stores it: a task per tile of T output
/// channels, reading its packed entries in order and writing its channels' rows side by side (a
/// task per output channel read every entry a stride T apart: a tenth of a weight gradient).
fn unpack(s: &Conv3dShape, t: usize, packed: &[f32]) -> Vec<f32> {
    let per_channel = s.rows();
    // SAFETY: each task writes every entry of its output channels.
    let mut dw = unsafe { uninit(s.o * per_channel) };
    dw.par_chunks_mut(t * per_channel).zip(packed.par_chunks(t * per_channel)).for_each(
        |(dst, src)| {
            for (i, lanes) in src.chunks_exact(t).enumerate() {
                let rows = dst[i..].iter_mut().step_by(per_channel);
                rows.zip(lanes).for_each(|(d, &v)| *d = v);
            }
        },
    );
    dw
}

/// The output gradient of block `b`'s voxels, each voxel's channels side by side: (samples,
/// slices, OH, OW, `t` x tiles), channels past O zero.
fn transposed(s: &Conv3dShape, t: usize, gy: &[f32], b: &Block) -> Vec<f32> {
    const RUN: usize = 64;
    let (ld, cols, plane) = (s.o.div_ceil(t) * t, s.cols(), s.output[1] * s.output[2]);
    let per_sample = b.zs.len() * plane;
    let mut out = vec![0f32; b.samples.len() * per_sample * ld];
    out.par_chunks_mut(per_sample * ld).enumerate().for_each(|(k, sample)| {
        let src = &gy[(b.samples.start + k) * s.o * cols + b.zs.start * plane..];
        sample.par_chunks_mut(RUN * ld).enumerate().for_each(|(task, dst)| {
            let (v0, len) = (task * RUN, dst.len() / ld);
            for o in 0..s.o {
                for (j, &g) in src[o * cols + v0..][..len].iter().enumerate() {
                    dst[j * ld + o] = g;
                }
            }
        });
    });
    out
}

/// One weight-gradient task's operands.
pub(super) struct GradArgs<'a> {
    /// The slab, and each of the task's kernel rows' offset in a sample of it.
    pub(super) x: *const f32,
    pub(super) groups: [usize; 8],
    /// The transposed output gradient at the task's tile, its voxels `ld` apart.
    pub(super) gy: *const f32,
    pub(super) ld: usize,
    /// Each kernel row's sums: kw taps of T lanes; with `fresh` (the first block) written, not
    /// added to (zeroing them first was a gradient-sized fill on one thread).
    pub(super) dw: [*mut f32; 8],
    pub(super) fresh: bool,
    pub(super) lines: &'a [(usize, usize)],
    pub(super) ow: usize,
}

/// A weight-gradient task: adds a block's voxels into its sums.
pub(super) type GradFn = unsafe fn(&GradArgs);

/// The weight-gradient kernel for `plan` with `groups` kernel rows `kw` wide and column stride
/// `stride`.
pub(super) fn grad_fn(plan: WeightPlan, kw: usize, groups: usize, stride: usize) -> GradFn {
    #[cfg(target_arch = "x86_64")]
    {
        super::x86::grad_fn(plan.isa, plan.vectors, kw, groups, stride)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (kw, groups, stride);
        unreachable!("no direct weight-gradient plan without x86-64: {plan:?}")
    }
}
