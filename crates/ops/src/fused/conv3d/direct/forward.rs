//! The direct convolution: output tiles of T channels x R rows x Q columns in vector registers
//! while every input channel and tap adds into them, a task per tile's run of rows, read from the
//! block's slab; the weights repacked as (O / T, C, taps, T), flipped for an input gradient
//! ([`Kernel::Flipped`]). Not here: the tile kernel itself (`simd`), the weight gradient
//! (`weight_gradient`).

use super::plan::Plan;
use super::slab::{Block, SlabShape};
use crate::fused::conv3d::input::Input;
use crate::fused::conv3d::shape::Conv3dShape;
use crate::fused::conv3d::Kernel;
use crate::fused::uninit::uninit;
use rayon::prelude::*;
use std::ops::Range;

/// The convolution `s` of x with w: (N, O, output) as one vector per part of the output channels
/// (`ranges`). `w`: the kernel (O, C, taps) as stored; with [`Kernel::Flipped`], the kernel (C, O,
/// taps) of the convolution whose input gradient this one is ([`Conv3dShape::transposed`]), read
/// end over end.
pub(crate) fn convolve(
    s: &Conv3dShape,
    plan: Plan,
    x: Input<f32>,
    w: &[f32],
    kernel: Kernel,
    ranges: &[Range<usize>],
) -> Vec<Vec<f32>> {
    let cols = s.cols();
    // SAFETY: the tiles write every output element (every channel, depth slice, row and column)
    // of every sample once.
    let mut ys: Vec<Vec<f32>> =
        ranges.iter().map(|r| unsafe { uninit(s.n * r.len() * cols) }).collect();
    let outputs = Outputs::new(&mut ys, ranges, s.o, cols);
    let weights = pack(s, plan.channels(), w, kernel);
    let slab = SlabShape::new(s, plan.cols, 0);
    for block in slab.blocks(s) {
        let data = slab.fill(s, x, &block);
        run_block(s, plan, &slab, &data, &weights, &outputs, &block);
    }
    ys
}

/// The kernel as the tiles read it: (O / T, C, taps, T), output channels past O zero. A task per
/// run of (tile, input channel) blocks, each block (taps, T) from T runs of `taps` weights (with
/// [`Kernel::Flipped`], read end over end), each run in place in w (indexing every element, the
/// packing took a fifth of a 3x3 convolution's forward at 8x8).
fn pack(s: &Conv3dShape, t: usize, w: &[f32], kernel: Kernel) -> Vec<f32> {
    let (c, o) = (s.c, s.o);
    let taps = s.rows() / c;
    // SAFETY: every block writes all its taps x T entries, the lanes past O included.
    let mut out = unsafe { uninit(o.div_ceil(t) * c * taps * t) };
    out.par_chunks_mut(taps * t).with_min_len(16).enumerate().for_each(|(i, block)| {
        let (tile, ch) = (i / c, i % c);
        let lanes = t.min(o - tile * t);
        for lane in 0..lanes {
            let oc = tile * t + lane;
            let at = match kernel {
                Kernel::Flipped => ch * o + oc,
                Kernel::AsIs => oc * c + ch,
            };
            let run = &w[at * taps..][..taps];
            let to = block[lane..].iter_mut().step_by(t);
            match kernel {
                Kernel::Flipped => to.zip(run.iter().rev()).for_each(|(d, &v)| *d = v),
                Kernel::AsIs => to.zip(run).for_each(|(d, &v)| *d = v),
            }
        }
        for lane in lanes..t {
            block[lane..].iter_mut().step_by(t).for_each(|d| *d = 0.0);
        }
    });
    out
}

/// Where the output channels go: each part's elements, shared by the tasks, which write disjoint
/// elements.
struct Outputs {
    parts: Vec<(*mut f32, usize)>,
    /// For each output channel, its part and its index there.
    channel: Vec<(usize, usize)>,
    cols: usize,
}

// SAFETY: the tasks write disjoint elements (their own channels, slice and rows) and nothing reads
// them until every task is done.
unsafe impl Sync for Outputs {}

impl Outputs {
    fn new(ys: &mut [Vec<f32>], ranges: &[Range<usize>], o: usize, cols: usize) -> Outputs {
        let parts = ys.iter_mut().zip(ranges).map(|(y, r)| (y.as_mut_ptr(), r.len())).collect();
        let channel = (0..o)
            .map(|oc| {
                let part = ranges.iter().position(|r| r.contains(&oc)).expect("a part");
                (part, oc - ranges[part].start)
            })
            .collect();
        Outputs { parts, channel, cols }
    }

    /// Writes `values` into output channel `oc` of sample `n` from position `at` of its plane.
    ///
    /// # Safety
    /// `at` plus the values' count is within the output's `cols`, and no other task writes them.
    unsafe fn write(&self, n: usize, oc: usize, at: usize, values: impl Iterator<Item = f32>) {
        let (part, local) = self.channel[oc];
        let (ptr, channels) = self.parts[part];
        let base = ptr.add((n * channels + local) * self.cols + at);
        for (i, v) in values.enumerate() {
            *base.add(i) = v;
        }
    }
}

/// One tile's operands: where its input starts in the slab, how to step through it, and its
/// weights.
pub(super) struct TileArgs<'a> {
    pub(super) x: *const f32,
    /// Elements between the slab's channels, and between the tile's input rows.
    pub(super) channel: usize,
    pub(super) row: usize,
    /// Each tap's offset from the tile's input start.
    pub(super) taps: &'a [usize],
    /// Each kernel row's first tap's offset, and the elements from there to the row's last read.
    pub(super) kernel_rows: &'a [usize],
    pub(super) span: usize,
    pub(super) w: *const f32,
    pub(super) c: usize,
}

/// A tile's sums into `out`, (R, Q, T).
pub(super) type TileFn = unsafe fn(&TileArgs, *mut f32);

/// Block `b` from its slab: a task per output-channel tile, sample, slice and run of R rows, each
/// walking its rows' column tiles.
fn run_block(
    s: &Conv3dShape,
    plan: Plan,
    slab: &SlabShape,
    data: &[f32],
    weights: &[f32],
    outputs: &Outputs,
    b: &Block,
) {
    let [_, oh, ow] = s.output;
    let (t, taps) = (plan.channels(), slab.taps(s));
    let kernel_rows: Vec<usize> = taps.iter().copied().step_by(s.kernel[2]).collect();
    let span = (plan.cols - 1) * s.stride[2] + s.kernel[2] - 1;
    let channel = slab.channel(s, b);
    let row_runs = oh.div_ceil(plan.rows);
    let tiles_o = s.o.div_ceil(t);
    let per_tile = b.samples.len() * b.zs.len() * row_runs;
    // Tasks of one tile side by side: a thread's run of them reads the tile's weights from its
    // cache (taken sample by sample, the 3x3 convolutions at 4x4 read all their weights, 9 MiB
    // in ResNet's last stage, from memory again for each sample: 2.3x oneDNN's time).
    (0..tiles_o * per_tile).into_par_iter().for_each(|task| {
        let (tile, rest) = (task / per_tile, task % per_tile);
        let (k, rest) = (rest / (b.zs.len() * row_runs), rest % (b.zs.len() * row_runs));
        let (z, y0) = (rest / row_runs, (rest % row_runs) * plan.rows);
        let rows = plan.rows.min(oh - y0);
        let kernel = tile_fn(plan, rows, s.stride[2]);
        let mut sums = [0f32; MAX_TILE];
        for x0 in (0..ow).step_by(plan.cols) {
            let args = TileArgs {
                x: data[k * s.c * channel + slab.at(s, z, y0, x0)..].as_ptr(),
                channel,
                row: s.stride[1] * slab.width,
                taps: &taps,
                kernel_rows: &kernel_rows,
                span,
                w: weights[tile * s.c * taps.len() * t..].as_ptr(),
                c: s.c,
            };
            // SAFETY: the slab holds every element the tile reads (its rows are padded for the
            // last column tile, its planes for the slices' taps), the weights a whole tile, and
            // `sums` R x Q x T.
            unsafe { kernel(&args, sums.as_mut_ptr()) };
            let q = plan.cols.min(ow - x0);
            for lane in 0..t.min(s.o - tile * t) {
                for r in 0..rows {
                    let at = ((b.zs.start + z) * oh + y0 + r) * ow + x0;
                    let values = (0..q).map(|j| sums[(r * plan.cols + j) * t + lane]);
                    // SAFETY: this task alone writes channel tile x slice x rows of its sample,
                    // and columns x0..x0 + q lie within the row.
                    unsafe { outputs.write(b.samples.start + k, tile * t + lane, at, values) };
                }
            }
        }
    });
}

/// The largest tile, R x Q x T elements: 3 x 8 x 32 on AVX-512.
const MAX_TILE: usize = 3 * 8 * 32;

/// The tile kernel for `plan` with `rows` rows and column stride `stride`.
pub(super) fn tile_fn(plan: Plan, rows: usize, stride: usize) -> TileFn {
    #[cfg(target_arch = "x86_64")]
    {
        super::x86::tile_fn(plan.isa, plan.vectors, rows, plan.cols, stride)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (rows, stride);
        unreachable!("no direct convolution plan without x86-64: {plan:?}")
    }
}
