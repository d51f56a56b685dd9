//! The direct kernels' instances on x86-64: the AVX-512 and AVX2 (with FMA) vectors ([`Simd`]),
//! the kernels compiled for each with its features enabled, and the table from run-time sizes to
//! the instance (the plans make no others). Not here: the kernels' code (`simd`).

use super::forward::{TileArgs, TileFn};
use super::plan::Isa;
use super::simd::{grad, tile, Simd};
use super::weight_gradient::{GradArgs, GradFn};
use std::arch::x86_64::*;

/// `$f::<A, B, C, SX>` as a `$ty` for the run-time sizes `($a, $b, $c, $sx)`, if (A, B, C) is
/// one of the listed instances (each with a column stride SX of 1 and of 2).
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

/// The instance of the weight-gradient kernel for these sizes ([`super::plan::WeightPlan::of`]
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
    .unwrap_or_else(|| unreachable!("no {isa:?} weight gradient {nv} x {kw} x {g}, stride {sx}"))
}

/// The instance of the tile for these sizes ([`super::plan::Plan::of`] makes no others).
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
