//! The two register-tile kernels of the direct convolution, written once over a vector of f32
//! lanes ([`Simd`]): [`tile`] (an output tile's sums over every input channel and tap) and
//! [`grad`] (a weight-gradient task's sums over a block's voxels). Not here: their instances for
//! an instruction set (`x86`), the work they are given (`forward`, `weight_gradient`).

use super::forward::TileArgs;
use super::weight_gradient::GradArgs;

/// How many channels ahead a tile asks for its input lines.
const PREFETCH_CHANNELS: usize = 2;

/// A vector of f32 lanes and the operations a tile needs.
pub(super) trait Simd {
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
/// # Safety `args` describe memory the caller owns (see `forward::run_block`); the processor has
/// `S`'s features, whose entry function this is inlined into.
#[inline(always)]
pub(super) unsafe fn tile<
    S: Simd,
    const NV: usize,
    const R: usize,
    const Q: usize,
    const SX: usize,
>(
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
/// As [`tile`], for `weight_gradient`'s operands.
#[inline(always)]
pub(super) unsafe fn grad<
    S: Simd,
    const NV: usize,
    const KW: usize,
    const G: usize,
    const SX: usize,
>(
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
