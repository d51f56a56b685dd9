//! How the kernels split their work over threads and still give the same bits at any number of
//! them: an elementwise op in fixed chunks of elements ([`ELEMENT_CHUNK`]), a reduction across
//! rows in fixed chunks of rows whose partial sums are added in order ([`sum_rows`],
//! [`sum_chunks`]), a long sum as interleaved partial sums added in order ([`sum_lanes`]). Not
//! here: the matrix product's own split (`matmul`).

use super::elem::{nan_max, Elem};
use rayon::prelude::*;

/// Rows per chunk of a cross-row reduction: fixed, so the summation order is too.
const CHUNK_ROWS: usize = 64;

/// Elements per parallel task of an elementwise op (dropout, GELU); a multiple of 2, so no dropout
/// task starts inside a stream word.
pub(crate) const ELEMENT_CHUNK: usize = 1 << 14;

/// The sum of `xs` as `LANES` interleaved partial sums added in order at the end: one fixed order,
/// which vectorises, where a single running sum waits for each addition in turn (the
/// up-convolution's bias gradient, summed so, took as long as its input gradient).
pub(crate) fn sum_lanes<T: Elem>(xs: &[T]) -> T {
    fold_lanes(xs, T::zero(), |a, v| a + v)
}

/// The maximum of `xs` (NaN winning, [`nan_max`]; -inf for none), in lanes as [`sum_lanes`].
pub(crate) fn max_lanes<T: Elem>(xs: &[T]) -> T {
    fold_lanes(xs, T::neg_infinity(), nan_max)
}

/// `xs` folded by `f` from `init` as `LANES` interleaved partial folds, folded in order at the end.
fn fold_lanes<T: Elem>(xs: &[T], init: T, f: impl Fn(T, T) -> T) -> T {
    const LANES: usize = 16;
    let mut acc = [init; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        acc.iter_mut().zip(chunk).for_each(|(a, &v)| *a = f(*a, v));
    }
    acc.iter_mut().zip(rest).for_each(|(a, &v)| *a = f(*a, v));
    acc.into_iter().fold(init, f)
}

/// The sum of `a[i] * b[i]`, in [`sum_lanes`]'s order.
pub(crate) fn dot_lanes<T: Elem>(a: &[T], b: &[T]) -> T {
    const LANES: usize = 16;
    assert_eq!(a.len(), b.len(), "dot_lanes: lengths differ");
    let mut acc = [T::zero(); LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        acc.iter_mut().zip(x.iter().zip(y)).for_each(|(a, (&x, &y))| *a += x * y);
    }
    acc.iter_mut().zip(ra.iter().zip(rb)).for_each(|(a, (&x, &y))| *a += x * y);
    acc.into_iter().fold(T::zero(), |s, a| s + a)
}

/// Sums `n_rows` rows' contributions of width `width` (from `row(i, out)`, which adds row i into
/// `out`) in fixed chunks of rows, the chunks' partial sums then added in order.
pub(crate) fn sum_rows<T: Elem>(
    n_rows: usize,
    width: usize,
    row: impl Fn(usize, &mut [T]) + Sync,
) -> Vec<T> {
    sum_chunks(n_rows, CHUNK_ROWS, width, row)
}

/// [`sum_rows`] in chunks of `chunk` rows: fixed by the caller, not by the threads, so the sums'
/// order is too.
pub(crate) fn sum_chunks<T: Elem>(
    n_rows: usize,
    chunk: usize,
    width: usize,
    row: impl Fn(usize, &mut [T]) + Sync,
) -> Vec<T> {
    let partials: Vec<Vec<T>> = (0..n_rows.div_ceil(chunk))
        .into_par_iter()
        .map(|c| {
            let mut acc = vec![T::zero(); width];
            (c * chunk..((c + 1) * chunk).min(n_rows)).for_each(|i| row(i, &mut acc));
            acc
        })
        .collect();
    let mut total = vec![T::zero(); width];
    for p in partials {
        total.iter_mut().zip(p).for_each(|(t, v)| *t += v);
    }
    total
}
