//! Direct convolution in f32 on x86-64 with AVX-512, or AVX2 and FMA, chosen at run time: no
//! operand matrix. An output tile of T channels x R rows x Q columns lives in vector registers
//! (T channels side by side in a vector) while every input channel and kernel tap adds into it:
//! each step loads T weights and broadcasts R x Q input elements, one multiply-add per pair, which
//! is oneDNN's forward kernel on a channel-blocked layout. The input is read from a zero-padded
//! copy of a few depth planes at a time (a slab), so a tap is one fixed offset for every position
//! and no border needs a test; the weights are repacked as (O / T, C, taps, T).
//!
//! Each output element is one tile's sum over the channels and taps in a fixed order, whatever the
//! threads: the bits do not depend on their number. Not here: other element types (f64 takes the
//! matrix products), 1x1x1 kernels (a matrix product of the input, strided or not, which the
//! kernel bench times faster than these tiles at the ResNets' shapes), column strides above 2.

use super::{Conv3dShape, Input};
use rayon::prelude::*;
use std::ops::Range;

/// How a convolution runs directly on this machine: the instruction set and the tile.
#[derive(Clone, Copy, Debug)]
pub(super) struct Plan {
    isa: Isa,
    /// Vectors of output channels per tile: T = `vectors` x the vector's lanes.
    vectors: usize,
    /// Output rows and columns per tile (R, Q).
    rows: usize,
    cols: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Isa {
    Avx512,
    Avx2,
}

impl Isa {
    /// The widest this processor has, if any.
    fn detect() -> Option<Isa> {
        Isa::available().first().copied()
    }

    /// Those this processor has, the widest first.
    fn available() -> Vec<Isa> {
        let mut isas = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                isas.push(Isa::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                isas.push(Isa::Avx2);
            }
        }
        isas
    }

    /// f32 lanes of a vector.
    fn lanes(self) -> usize {
        match self {
            Isa::Avx512 => 16,
            Isa::Avx2 => 8,
        }
    }

    /// Accumulators a tile may hold: the registers (32 or 16) less the weights' vectors and the
    /// broadcast, with one to spare.
    fn accumulators(self, vectors: usize) -> usize {
        match self {
            Isa::Avx512 => 30 - vectors,
            Isa::Avx2 => 14 - vectors,
        }
    }
}

impl Plan {
    /// The plan for convolution `s`, where it runs directly: a kernel other than 1x1x1, a column
    /// stride of 1 or 2, on a processor with AVX2 and FMA or AVX-512. Two vectors of output
    /// channels per tile where they fill it ([`vectors`]), else one; eight columns where the
    /// output rows are made of eights, else four; as many rows as the accumulators allow, up to
    /// three.
    pub(super) fn of(s: &Conv3dShape) -> Option<Plan> {
        Plan::for_isa(s, Isa::detect()?)
    }

    fn for_isa(s: &Conv3dShape, isa: Isa) -> Option<Plan> {
        if s.kernel == [1; 3] || s.stride[2] > 2 {
            return None;
        }
        let vectors = vectors(s, isa);
        let ow = s.output[2];
        let budget = isa.accumulators(vectors);
        let cols = if ow.is_multiple_of(8) && 8 * vectors <= budget { 8 } else { 4 };
        let rows = (budget / (cols * vectors)).clamp(1, 3).min(s.output[1]);
        Some(Plan { isa, vectors, rows, cols })
    }

    /// Output channels per tile.
    fn channels(&self) -> usize {
        self.vectors * self.isa.lanes()
    }
}

/// Vectors of output channels per tile: two where they fill it (halving the broadcasts per
/// multiply-add), else one.
fn vectors(s: &Conv3dShape, isa: Isa) -> usize {
    if s.o.is_multiple_of(2 * isa.lanes()) {
        2
    } else {
        1
    }
}

/// How a weight gradient runs directly on this machine: the instruction set, the vectors of
/// output channels per task, and the kernel rows (input channel, kd, kh) a task sums at once.
#[derive(Clone, Copy, Debug)]
pub(super) struct WeightPlan {
    isa: Isa,
    vectors: usize,
    groups: usize,
}

impl WeightPlan {
    /// The plan for the weight gradient of convolution `s`, where it runs directly: a kernel
    /// other than 1x1x1 and 1, 2, 3 or 7 wide, a column stride of 1 or 2, on a processor with
    /// AVX2 and FMA or AVX-512. As many kernel rows at once as the accumulators (rows x kw x
    /// vectors) allow, up to four, or eight where they divide the rows.
    pub(super) fn of(s: &Conv3dShape) -> Option<WeightPlan> {
        WeightPlan::for_isa(s, Isa::detect()?)
    }

    fn for_isa(s: &Conv3dShape, isa: Isa) -> Option<WeightPlan> {
        let kw = s.kernel[2];
        if s.kernel == [1; 3] || s.stride[2] > 2 || ![1, 2, 3, 7].contains(&kw) {
            return None;
        }
        let rows = s.c * s.kernel[0] * s.kernel[1];
        let fits = |v: usize, g: usize| g * kw * v <= isa.accumulators(v);
        let vectors = [vectors(s, isa), 1].into_iter().find(|&v| fits(v, 1))?;
        let groups = [8, 4, 3, 2, 1]
            .into_iter()
            .find(|&g| fits(vectors, g) && (g < 8 || rows.is_multiple_of(8)))?;
        Some(WeightPlan { isa, vectors, groups })
    }

    fn channels(&self) -> usize {
        self.vectors * self.isa.lanes()
    }
}

/// The weight gradient (O, C, taps) of convolution `s` of x from its output gradient gy (N, O,
/// output): for each output channel, tap and input channel, the sum over every output voxel of
/// gy times the input it read. A task per output-channel tile and run of kernel rows, its sums
/// in registers over a block's voxels, the blocks in order: each sum in one fixed order.
pub(super) fn weight_gradient(
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
    let mut packed = unsafe { super::super::sums(parts * size, blocks.len()) };
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
    let mut dw = unsafe { super::super::uninit(s.o * per_channel) };
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

/// The convolution `s` of x with w: (N, O, output) as one vector per part of the output channels
/// (`ranges`). `w`: the kernel (O, C, taps) as stored; with `flip`, the kernel (C, O, taps) of the
/// convolution whose input gradient this one is ([`Conv3dShape::transposed`]), read end over end.
pub(super) fn convolve(
    s: &Conv3dShape,
    plan: Plan,
    x: Input<f32>,
    w: &[f32],
    flip: bool,
    ranges: &[Range<usize>],
) -> Vec<Vec<f32>> {
    let cols = s.cols();
    // SAFETY: the tiles write every output element (every channel, depth slice, row and column)
    // of every sample once.
    let mut ys: Vec<Vec<f32>> =
        ranges.iter().map(|r| unsafe { super::super::uninit(s.n * r.len() * cols) }).collect();
    let outputs = Outputs::new(&mut ys, ranges, s.o, cols);
    let weights = pack(s, plan.channels(), w, flip);
    let slab = SlabShape::new(s, plan.cols, 0);
    for block in slab.blocks(s) {
        let data = slab.fill(s, x, &block);
        run_block(s, plan, &slab, &data, &weights, &outputs, &block);
    }
    ys
}

/// The kernel as the tiles read it: (O / T, C, taps, T), output channels past O zero. A task per
/// run of (tile, input channel) blocks, each block (taps, T) from T runs of `taps` weights (with
/// `flip`, read end over end), each run in place in w (indexing every element, the packing took
/// a fifth of a 3x3 convolution's forward at 8x8).
fn pack(s: &Conv3dShape, t: usize, w: &[f32], flip: bool) -> Vec<f32> {
    let (c, o) = (s.c, s.o);
    let taps = s.rows() / c;
    // SAFETY: every block writes all its taps x T entries, the lanes past O included.
    let mut out = unsafe { super::super::uninit(o.div_ceil(t) * c * taps * t) };
    out.par_chunks_mut(taps * t).with_min_len(16).enumerate().for_each(|(i, block)| {
        let (tile, ch) = (i / c, i % c);
        let lanes = t.min(o - tile * t);
        for lane in 0..lanes {
            let oc = tile * t + lane;
            let at = if flip { ch * o + oc } else { oc * c + ch };
            let run = &w[at * taps..][..taps];
            let to = block[lane..].iter_mut().step_by(t);
            match flip {
                true => to.zip(run.iter().rev()).for_each(|(d, &v)| *d = v),
                false => to.zip(run).for_each(|(d, &v)| *d = v),
            }
        }
        for lane in lanes..t {
            block[lane..].iter_mut().step_by(t).for_each(|d| *d = 0.0);
        }
    });
    out
}

/// A block of the work: output depth slices `zs` of samples `samples`, read from one slab.
struct Block {
    samples: Range<usize>,
    zs: Range<usize>,
}

/// The zero-padded input planes a block reads: (samples, C, planes, H + 2 pad, `width`), the rows
/// wide enough that every column tile, the last one's included, reads inside its own row.
struct SlabShape {
    rows: usize,
    width: usize,
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
    fn new(s: &Conv3dShape, cols: usize, voxel: usize) -> SlabShape {
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

    fn blocks(&self, s: &Conv3dShape) -> Vec<Block> {
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
    fn channel(&self, s: &Conv3dShape, b: &Block) -> usize {
        const LINE: usize = 16;
        let lines = self.planes_len(s, b).div_ceil(LINE);
        (lines | 1) * LINE
    }

    /// The slab of block `b`, a channel of a sample per task.
    fn fill(&self, s: &Conv3dShape, x: Input<f32>, b: &Block) -> Vec<f32> {
        let ([d, h, w], [pd, ph, pw]) = (s.input, s.pad);
        let channel = self.channel(s, b);
        // SAFETY: every row of every plane of every channel is written below.
        let mut slab = unsafe { super::super::uninit(b.samples.len() * s.c * channel) };
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
    fn taps(&self, s: &Conv3dShape) -> Vec<usize> {
        let [kd, kh, kw] = s.kernel;
        (0..kd * kh * kw)
            .map(|k| ((k / (kh * kw) * self.rows) + (k / kw) % kh) * self.width + k % kw)
            .collect()
    }

    /// Each output line (sample, slice, row) of block `b`: where its first voxel reads its first
    /// tap in the slab, and that voxel's index among the block's.
    fn lines(&self, s: &Conv3dShape, b: &Block) -> Vec<(usize, usize)> {
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
    fn at(&self, s: &Conv3dShape, z: usize, y: usize, x: usize) -> usize {
        (z * s.stride[0] * self.rows + y * s.stride[1]) * self.width + x * s.stride[2]
    }
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
struct TileArgs<'a> {
    x: *const f32,
    /// Elements between the slab's channels, and between the tile's input rows.
    channel: usize,
    row: usize,
    /// Each tap's offset from the tile's input start.
    taps: &'a [usize],
    /// Each kernel row's first tap's offset, and the elements from there to the row's last read.
    kernel_rows: &'a [usize],
    span: usize,
    w: *const f32,
    c: usize,
}

/// A tile's sums into `out`, (R, Q, T).
type TileFn = unsafe fn(&TileArgs, *mut f32);

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

/// One weight-gradient task's operands.
struct GradArgs<'a> {
    /// The slab, and each of the task's kernel rows' offset in a sample of it.
    x: *const f32,
    groups: [usize; 8],
    /// The transposed output gradient at the task's tile, its voxels `ld` apart.
    gy: *const f32,
    ld: usize,
    /// Each kernel row's sums: kw taps of T lanes; with `fresh` (the first block) written, not
    /// added to (zeroing them first was a gradient-sized fill on one thread).
    dw: [*mut f32; 8],
    fresh: bool,
    lines: &'a [(usize, usize)],
    ow: usize,
}

/// A weight-gradient task: adds a block's voxels into its sums.
type GradFn = unsafe fn(&GradArgs);

/// The weight-gradient kernel for `plan` with `groups` kernel rows `kw` wide and column stride
/// `stride`.
fn grad_fn(plan: WeightPlan, kw: usize, groups: usize, stride: usize) -> GradFn {
    #[cfg(target_arch = "x86_64")]
    {
        x86::grad_fn(plan.isa, plan.vectors, kw, groups, stride)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (kw, groups, stride);
        unreachable!("no direct weight-gradient plan without x86-64: {plan:?}")
    }
}

/// The largest tile, R x Q x T elements: 3 x 8 x 32 on AVX-512.
const MAX_TILE: usize = 3 * 8 * 32;

/// The tile kernel for `plan` with `rows` rows and column stride `stride`.
fn tile_fn(plan: Plan, rows: usize, stride: usize) -> TileFn {
    #[cfg(target_arch = "x86_64")]
    {
        x86::tile_fn(plan.isa, plan.vectors, rows, plan.cols, stride)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (rows, stride);
        unreachable!("no direct convolution plan without x86-64: {plan:?}")
    }
}

/// How many channels ahead a tile asks for its input lines.
const PREFETCH_CHANNELS: usize = 2;

/// A vector of f32 lanes and the operations a tile needs.
trait Simd {
    type V: Copy;
    const LANES: usize;
    unsafe fn zero() -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn splat(p: *const f32) -> Self::V;
    /// a x b + c
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    /// Asks for the cache line at `p` (never faults, wherever `p` points).
    unsafe fn prefetch(p: *const f32);
}

/// The tile: for every input channel and tap, NV weight vectors times R x Q broadcast input
/// elements, added into R x Q x NV accumulators; then stored (R, Q, T).
///
/// # Safety
/// `args` describe memory the caller owns (see [`run_block`]); the processor has `S`'s features,
/// whose entry function this is inlined into.
#[inline(always)]
unsafe fn tile<S: Simd, const NV: usize, const R: usize, const Q: usize, const SX: usize>(
    args: &TileArgs,
    out: *mut f32,
) {
    let mut acc = [[[S::zero(); NV]; Q]; R];
    let mut w = args.w;
    for ch in 0..args.c {
        let x = args.x.add(ch * args.channel);
        // The channel after next's lines, asked for now: a tile reads a few lines of each
        // channel, a channel's stride apart, which the hardware prefetchers do not foresee (the
        // up-convolution's input gradient, 4 lines per channel, waited on them at 107 GFLOP/s).
        // A kernel row's taps read the same line or two: asking for each tap's was a fifth of
        // the tile's instructions.
        let ahead = x.wrapping_add(PREFETCH_CHANNELS * args.channel);
        for &off in args.kernel_rows {
            for r in 0..R {
                S::prefetch(ahead.wrapping_add(off + r * args.row));
                S::prefetch(ahead.wrapping_add(off + r * args.row + args.span));
            }
        }
        for &off in args.taps {
            let mut wv = [S::zero(); NV];
            for (v, wv) in wv.iter_mut().enumerate() {
                *wv = S::load(w.add(v * S::LANES));
            }
            w = w.add(NV * S::LANES);
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = x.add(off + r * args.row);
                for (q, acc) in acc.iter_mut().enumerate() {
                    let b = S::splat(x.add(q * SX));
                    for v in 0..NV {
                        acc[v] = S::fma(b, wv[v], acc[v]);
                    }
                }
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (q, acc) in acc.iter().enumerate() {
            for (v, &a) in acc.iter().enumerate() {
                S::store(out.add(((r * Q + q) * NV + v) * S::LANES), a);
            }
        }
    }
}

/// Weight-gradient sums: for every voxel of every line, NV vectors of the output gradient times
/// the G x KW input elements its taps read, added into G x KW x NV accumulators that start from
/// and end in the task's sums (start from zero in the first block).
///
/// # Safety
/// As [`tile`], for [`weight_gradient`]'s operands.
#[inline(always)]
unsafe fn grad<S: Simd, const NV: usize, const KW: usize, const G: usize, const SX: usize>(
    args: &GradArgs,
) {
    let mut acc = [[[S::zero(); NV]; KW]; G];
    if !args.fresh {
        for (g, acc) in acc.iter_mut().enumerate() {
            for (k, acc) in acc.iter_mut().enumerate() {
                for (v, acc) in acc.iter_mut().enumerate() {
                    *acc = S::load(args.dw[g].add((k * NV + v) * S::LANES));
                }
            }
        }
    }
    for &(start, first) in args.lines {
        for j in 0..args.ow {
            let gy = args.gy.add((first + j) * args.ld);
            let mut gv = [S::zero(); NV];
            for (v, gv) in gv.iter_mut().enumerate() {
                *gv = S::load(gy.add(v * S::LANES));
            }
            let x = args.x.add(start + j * SX);
            for (g, acc) in acc.iter_mut().enumerate() {
                let x = x.add(args.groups[g]);
                for (k, acc) in acc.iter_mut().enumerate() {
                    let b = S::splat(x.add(k));
                    for v in 0..NV {
                        acc[v] = S::fma(b, gv[v], acc[v]);
                    }
                }
            }
        }
    }
    for (g, acc) in acc.iter().enumerate() {
        for (k, acc) in acc.iter().enumerate() {
            for (v, &a) in acc.iter().enumerate() {
                S::store(args.dw[g].add((k * NV + v) * S::LANES), a);
            }
        }
    }
}

/// `$f::<A, B, C, SX>` as a `$ty` for the run-time sizes `($a, $b, $c, $sx)`, if (A, B, C) is
/// one of the listed instances (each with a column stride SX of 1 and of 2).
#[cfg(target_arch = "x86_64")]
macro_rules! instance {
    ($ty:ty, $f:ident, ($a:expr, $b:expr, $c:expr, $sx:expr):
     $(($x:literal, $y:literal, $z:literal)),+) => {
        match ($a, $b, $c, $sx) {
            $(
                ($x, $y, $z, 1) => Some($f::<$x, $y, $z, 1> as $ty),
                ($x, $y, $z, 2) => Some($f::<$x, $y, $z, 2> as $ty),
            )+
            _ => None,
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{grad, tile, GradArgs, GradFn, Isa, Simd, TileArgs, TileFn};
    use std::arch::x86_64::*;

    struct Avx512;
    struct Avx2;

    impl Simd for Avx512 {
        type V = __m512;
        const LANES: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn splat(p: *const f32) -> __m512 {
            _mm512_set1_ps(*p)
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const f32) {
            _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
        }
    }

    impl Simd for Avx2 {
        type V = __m256;
        const LANES: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn splat(p: *const f32) -> __m256 {
            _mm256_broadcast_ss(&*p)
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            _mm256_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const f32) {
            _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn avx512<const NV: usize, const R: usize, const Q: usize, const SX: usize>(
        args: &TileArgs,
        out: *mut f32,
    ) {
        tile::<Avx512, NV, R, Q, SX>(args, out)
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2<const NV: usize, const R: usize, const Q: usize, const SX: usize>(
        args: &TileArgs,
        out: *mut f32,
    ) {
        tile::<Avx2, NV, R, Q, SX>(args, out)
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn grad512<const NV: usize, const KW: usize, const G: usize, const SX: usize>(
        args: &GradArgs,
    ) {
        grad::<Avx512, NV, KW, G, SX>(args)
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn grad2<const NV: usize, const KW: usize, const G: usize, const SX: usize>(
        args: &GradArgs,
    ) {
        grad::<Avx2, NV, KW, G, SX>(args)
    }

    /// The instance of the weight-gradient kernel for these sizes ([`super::WeightPlan::of`]
    /// makes no others: the rows that fit its accumulators).
    pub(super) fn grad_fn(isa: Isa, nv: usize, kw: usize, g: usize, sx: usize) -> GradFn {
        match isa {
            Isa::Avx512 => instance!(GradFn, grad512, (nv, kw, g, sx):
                (1, 1, 1), (1, 1, 2), (1, 1, 3), (1, 1, 4), (1, 1, 8),
                (1, 2, 1), (1, 2, 2), (1, 2, 3), (1, 2, 4), (1, 2, 8),
                (1, 3, 1), (1, 3, 2), (1, 3, 3), (1, 3, 4), (1, 3, 8),
                (1, 7, 1), (1, 7, 2), (1, 7, 3), (1, 7, 4),
                (2, 1, 1), (2, 1, 2), (2, 1, 3), (2, 1, 4), (2, 1, 8),
                (2, 2, 1), (2, 2, 2), (2, 2, 3), (2, 2, 4),
                (2, 3, 1), (2, 3, 2), (2, 3, 3), (2, 3, 4),
                (2, 7, 1), (2, 7, 2)),
            Isa::Avx2 => instance!(GradFn, grad2, (nv, kw, g, sx):
                (1, 1, 1), (1, 1, 2), (1, 1, 3), (1, 1, 4), (1, 1, 8),
                (1, 2, 1), (1, 2, 2), (1, 2, 3), (1, 2, 4),
                (1, 3, 1), (1, 3, 2), (1, 3, 3), (1, 3, 4),
                (1, 7, 1),
                (2, 1, 1), (2, 1, 2), (2, 1, 3), (2, 1, 4),
                (2, 2, 1), (2, 2, 2), (2, 2, 3),
                (2, 3, 1), (2, 3, 2)),
        }
        .unwrap_or_else(|| {
            unreachable!("no {isa:?} weight gradient {nv} x {kw} x {g}, stride {sx}")
        })
    }

    /// The instance of the tile for these sizes ([`super::Plan::of`] makes no others).
    pub(super) fn tile_fn(isa: Isa, nv: usize, r: usize, q: usize, sx: usize) -> TileFn {
        match isa {
            Isa::Avx512 => instance!(TileFn, avx512, (nv, r, q, sx):
                (1, 1, 8), (1, 2, 8), (1, 3, 8), (2, 1, 8),
                (1, 1, 4), (1, 2, 4), (1, 3, 4), (2, 1, 4), (2, 2, 4), (2, 3, 4)),
            Isa::Avx2 => instance!(TileFn, avx2, (nv, r, q, sx):
                (1, 1, 8), (1, 1, 4), (1, 2, 4), (1, 3, 4), (2, 1, 4)),
        }
        .unwrap_or_else(|| unreachable!("no {isa:?} tile of {nv} x {r} x {q}, stride {sx}"))
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::Conv3dGeometry;
    use super::*;

    fn rand(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn close(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{what}: element {i}: {g} vs {w}");
        }
    }

    type Dims = (usize, usize, usize, usize, usize);

    /// Shapes that take each kind of tile: output channels that do not fill a vector, rows that
    /// are not made of fours or eights, strides of 2, kernels 1, 3 and 7 wide, 2D and 3D.
    fn cases() -> Vec<(Dims, Dims, Conv3dGeometry)> {
        let strided = |pad| Conv3dGeometry { stride_d: 1, stride_hw: 2, pad_d: 0, pad_hw: pad };
        vec![
            ((2, 5, 5, 6, 7), (6, 5, 3, 3, 3), Conv3dGeometry::same(3)),
            ((2, 16, 4, 8, 8), (32, 16, 3, 3, 3), Conv3dGeometry::same(3)),
            ((3, 4, 1, 9, 9), (40, 4, 1, 3, 3), strided(1)),
            ((2, 3, 1, 15, 15), (64, 3, 1, 7, 7), strided(3)),
            ((2, 8, 4, 10, 10), (32, 8, 3, 1, 1), Conv3dGeometry { pad_d: 1, ..strided(0) }),
            ((1, 3, 6, 5, 4), (16, 3, 3, 3, 3), Conv3dGeometry { stride_d: 2, ..strided(1) }),
        ]
    }

    /// The weight gradient by its definition.
    fn weight_gradient_naive(s: &Conv3dShape, x: &[f32], gy: &[f32]) -> Vec<f32> {
        let ([kd, kh, kw], [od, oh, ow], [d, h, w]) = (s.kernel, s.output, s.input);
        let mut dw = vec![0f32; s.o * s.c * kd * kh * kw];
        for (n, o, c) in
            (0..s.n).flat_map(|n| (0..s.o).flat_map(move |o| (0..s.c).map(move |c| (n, o, c))))
        {
            for (a, b, k) in
                (0..kd).flat_map(|a| (0..kh).flat_map(move |b| (0..kw).map(move |k| (a, b, k))))
            {
                let mut sum = 0f32;
                for (z, y, xx) in (0..od)
                    .flat_map(|z| (0..oh).flat_map(move |y| (0..ow).map(move |xx| (z, y, xx))))
                {
                    let (Some(zz), Some(yy), Some(xi)) =
                        (s.source(0, z, a), s.source(1, y, b), s.source(2, xx, k))
                    else {
                        continue;
                    };
                    sum += gy[((n * s.o + o) * od + z) * oh * ow + y * ow + xx]
                        * x[(((n * s.c + c) * d + zz) * h + yy) * w + xi];
                }
                dw[((o * s.c + c) * kd + a) * kh * kw + b * kw + k] += sum;
            }
        }
        dw
    }

    /// Every tile and weight-gradient kernel the plans can choose exists, on each instruction
    /// set this processor has.
    #[test]
    fn every_plan_has_its_kernels() {
        for isa in Isa::available() {
            for (o, ow, kw, sx) in (1..=70).flat_map(|o| {
                [1, 4, 7, 8, 16].into_iter().flat_map(move |ow| {
                    [1, 2, 3, 5, 7].into_iter().flat_map(move |kw| [1, 2].map(|sx| (o, ow, kw, sx)))
                })
            }) {
                let pad = kw / 2;
                let x = (1, 5, 1, 9, (ow - 1) * sx + kw - 2 * pad);
                let g = Conv3dGeometry { stride_d: 1, stride_hw: sx, pad_d: 0, pad_hw: pad };
                let s = Conv3dShape::new(x, (o, 5, 1, kw, kw), g, 1 << 20).unwrap();
                if let Some(plan) = Plan::for_isa(&s, isa) {
                    (1..=plan.rows).for_each(|r| {
                        let _ = tile_fn(plan, r, sx);
                    });
                }
                if let Some(plan) = WeightPlan::for_isa(&s, isa) {
                    (1..=plan.groups).for_each(|g| {
                        let _ = grad_fn(plan, kw, g, sx);
                    });
                }
            }
        }
    }

    /// The direct kernels give the matrix products' convolution, the input gradient's (the
    /// flipped kernel) and the weight gradient's definition, on each instruction set this
    /// processor has, with slabs of one depth plane, of several samples, and an input in two
    /// tensors written into two outputs.
    #[test]
    fn direct_convolutions_agree_with_the_matrix_products() {
        for isa in Isa::available() {
            for (case, &(xd, wd, g)) in cases().iter().enumerate() {
                for entries in [1, 1 << 16] {
                    let s = Conv3dShape::new(xd, wd, g, entries).unwrap();
                    let what = format!("{isa:?} {xd:?} {wd:?} {g:?} blocks of {entries}");
                    let x = rand(s.n * s.c * s.volume(), case as u64);
                    let w = rand(s.o * s.rows(), 100 + case as u64);
                    let gy = rand(s.n * s.o * s.cols(), 200 + case as u64);
                    let split = s.c / 2;
                    let (first, second): (Vec<f32>, Vec<f32>) = {
                        let per = s.c * s.volume();
                        let parts = x.chunks(per).map(|x_n| x_n.split_at(split * s.volume()));
                        let (a, b): (Vec<_>, Vec<_>) = parts.unzip();
                        (a.concat(), b.concat())
                    };
                    let two = Input { first: &first, second: &second, split };
                    let whole = Input::whole(&x, s.c);
                    let plan = Plan::for_isa(&s, isa).unwrap();
                    let parts = [0..s.o.min(3), s.o.min(3)..s.o];
                    let want = s.convolve(whole, &w, false, &[s.o.min(3), s.o - s.o.min(3)]);
                    for input in [whole, two] {
                        let got = convolve(&s, plan, input, &w, false, &parts);
                        close(&got.concat(), &want.concat(), &format!("forward, {what}"));
                    }
                    if s.unit_stride() {
                        let t = s.transposed();
                        let plan = Plan::for_isa(&t, isa).unwrap();
                        let gy_in = Input::whole(&gy, s.o);
                        let got = convolve(&t, plan, gy_in, &w, true, &t.part_ranges(&[s.c]));
                        let want = t.convolve(gy_in, &w, true, &[s.c]);
                        close(&got[0], &want[0], &format!("input gradient, {what}"));
                    }
                    let plan = WeightPlan::for_isa(&s, isa).unwrap();
                    let want = weight_gradient_naive(&s, &x, &gy);
                    for input in [whole, two] {
                        let got = weight_gradient(&s, plan, input, &gy);
                        close(&got, &want, &format!("weight gradient, {what}"));
                    }
                }
            }
        }
    }

    /// The same bits with 1, 2 or 7 threads.
    #[test]
    fn direct_convolutions_do_not_depend_on_the_threads() {
        let (xd, wd, g) = cases()[1];
        let s = Conv3dShape::new(xd, wd, g, 1 << 14).unwrap();
        let (x, w, gy) = (
            rand(s.n * s.c * s.volume(), 1),
            rand(s.o * s.rows(), 2),
            rand(s.n * s.o * s.cols(), 3),
        );
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let input = Input::whole(&x, s.c);
                let y =
                    convolve(&s, Plan::of(&s).unwrap(), input, &w, false, &s.part_ranges(&[s.o]));
                let dw = weight_gradient(&s, WeightPlan::of(&s).unwrap(), input, &gy);
                [y.concat(), dw].map(|v| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>())
            })
        };
        if Isa::detect().is_some() {
            let one = run(1);
            assert_eq!(one, run(2));
            assert_eq!(one, run(7));
        }
    }
}
