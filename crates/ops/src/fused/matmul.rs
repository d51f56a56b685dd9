//! The matrix product the kernels run: gemm, the product candle's CPU backend runs, called
//! directly on slices, so that a transposed operand or a block of a wider matrix is a stride, not
//! a copy ([`Mat`]), and the product is written (or added) in place; split over rayon's threads (candle's)
//! with the same bits at any number of them. Plus the machine's peak rate and the per-thread
//! workspaces measurements allocate first. Not here: products of tensors (candle's `matmul`, which
//! the generic route and attention use).

use super::elem::Elem;
use super::uninit::uninit;

/// A matrix operand of [`matmul`]: row-major elements, stored transposed or not, its stored rows
/// `ld` elements apart (packed unless [`Mat::ld`] says otherwise: a block of a wider matrix).
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a, T> {
    data: &'a [T],
    /// The stored matrix is the operand's transpose: (cols, rows) row-major.
    t: bool,
    ld: Option<usize>,
}

/// The operand stored in `data` as it is, row-major and packed: [`Mat::transposed`] for the
/// operand whose transpose `data` stores.
pub(crate) fn mat<T>(data: &[T]) -> Mat<'_, T> {
    Mat { data, t: false, ld: None }
}

impl<T> Mat<'_, T> {
    /// The operand's transpose (the same elements).
    pub(crate) fn transposed(self) -> Self {
        Mat { t: !self.t, ..self }
    }

    /// The stored rows are `ld` elements apart, not packed.
    pub(crate) fn ld(self, ld: usize) -> Self {
        Mat { ld: Some(ld), ..self }
    }

    /// (row stride, column stride) of this (rows, cols) operand, checked against its elements.
    fn strides(&self, rows: usize, cols: usize) -> (isize, isize) {
        let (stored_rows, stored_cols) = if self.t { (cols, rows) } else { (rows, cols) };
        let ld = self.ld.unwrap_or(stored_cols);
        // A packed operand is exactly its elements; a block of a wider matrix holds them.
        let holds = match self.ld {
            None => self.data.len() == rows * cols,
            Some(_) => {
                stored_rows == 0
                    || stored_cols == 0
                    || (ld >= stored_cols
                        && self.data.len() >= (stored_rows - 1) * ld + stored_cols)
            }
        };
        assert!(
            holds,
            "matmul: {} elements {ld} apart do not hold a ({rows}, {cols}) operand",
            self.data.len()
        );
        if self.t {
            (1, ld as isize)
        } else {
            (ld as isize, 1)
        }
    }
}

/// What a matrix product does with the elements of its destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dest {
    /// Writes the product over them, without reading them: they may be uninitialised.
    Overwrite,
    /// Adds the product to them.
    Accumulate,
}

/// `dst (m, n) (+)= a (m, k) @ b (k, n)`: [`matmul_strided`] into a packed row-major `dst`.
pub(crate) fn matmul<T: Elem>(
    dst: &mut [T],
    a: Mat<T>,
    b: Mat<T>,
    mkn: (usize, usize, usize),
    dest: Dest,
) {
    let threads = rayon::current_num_threads();
    matmul_on(threads, dst, (packed(dst, mkn), 1), a, b, mkn, dest)
}

/// [`matmul`] on this thread alone: for products that the caller runs side by side, each too
/// small to pay for splitting (a pointwise convolution's, one per sample).
pub(crate) fn matmul_alone<T: Elem>(
    dst: &mut [T],
    a: Mat<T>,
    b: Mat<T>,
    mkn: (usize, usize, usize),
    dest: Dest,
) {
    matmul_on(1, dst, (packed(dst, mkn), 1), a, b, mkn, dest)
}

/// The row stride of `dst` packing an (m, n) product, checked.
fn packed<T>(dst: &[T], (m, _, n): (usize, usize, usize)) -> usize {
    assert!(dst.len() == m * n, "matmul: {} elements do not pack a ({m}, {n}) product", dst.len());
    n
}

/// `dst (m, n) (+)= a (m, k) @ b (k, n)` with gemm, the matrix product candle's CPU backend runs,
/// called directly: operands are read in place (a transposed operand or a block of a wider matrix
/// is a stride, not a copy) and the product is written into `dst` at (row, column) strides
/// `dst_strides` (added to it with [`Dest::Accumulate`]; with [`Dest::Overwrite`], `dst` is only
/// written, so it may be uninitialised). Split over the rayon pool's threads (asked of rayon:
/// candle's `get_num_threads` reads /proc/cpuinfo at every call, a tenth of a second of a SmolLM2
/// step on one thread); the bits do not depend on their number (threads split the output, each
/// element's sum over k runs in one fixed order).
pub(crate) fn matmul_strided<T: Elem>(
    dst: &mut [T],
    dst_strides: (usize, usize),
    a: Mat<T>,
    b: Mat<T>,
    mkn: (usize, usize, usize),
    dest: Dest,
) {
    let threads = rayon::current_num_threads();
    matmul_on(threads, dst, dst_strides, a, b, mkn, dest)
}

/// [`matmul_strided`] split over `threads`.
fn matmul_on<T: Elem>(
    threads: usize,
    dst: &mut [T],
    (dst_rs, dst_cs): (usize, usize),
    a: Mat<T>,
    b: Mat<T>,
    (m, k, n): (usize, usize, usize),
    dest: Dest,
) {
    // The strides must not map two elements to one place: one of them spans the other's whole run.
    let apart = (dst_cs == 1 && dst_rs >= n) || (dst_rs == 1 && dst_cs >= m);
    assert!(
        m == 0 || n == 0 || (apart && dst.len() > (m - 1) * dst_rs + (n - 1) * dst_cs),
        "matmul: destination does not hold ({m}, {n})"
    );
    let ((a_rs, a_cs), (b_rs, b_cs)) = (a.strides(m, k), b.strides(k, n));
    let parallelism =
        if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: every access stays within the slices, whose lengths are checked above against the
    // shapes the strides describe.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            dst_cs as isize,
            dst_rs as isize,
            dest == Dest::Accumulate,
            a.data.as_ptr(),
            a_cs,
            a_rs,
            b.data.as_ptr(),
            b_cs,
            b_rs,
            T::one(),
            T::one(),
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// `a @ b` into a new (m, n) matrix.
pub(crate) fn matmul_new<T: Elem>(a: Mat<T>, b: Mat<T>, mkn: (usize, usize, usize)) -> Vec<T> {
    // SAFETY: the product writes every element.
    let mut dst = unsafe { uninit(mkn.0 * mkn.2) };
    matmul(&mut dst, a, b, mkn, Dest::Overwrite);
    dst
}

/// The rate of the matrix product on this machine at its best, in GFLOP/s: a (2048, 2048) @
/// (2048, 2048) f32 product on candle's threads, the fastest of five after a warm-up. The yardstick
/// a model's achieved rate is read against (a step is mostly products, most of them smaller).
pub fn matmul_peak_gflops() -> f64 {
    const N: usize = 2048;
    let a: Vec<f32> = (0..N * N).map(|i| (i % 7) as f32 * 0.1).collect();
    // SAFETY: the product writes every element.
    let mut dst = unsafe { uninit::<f32>(N * N) };
    let best = (0..6)
        .map(|_| {
            let t = std::time::Instant::now();
            matmul(&mut dst, mat(&a), mat(&a).transposed(), (N, N, N), Dest::Overwrite);
            t.elapsed().as_secs_f64()
        })
        .skip(1)
        .fold(f64::INFINITY, f64::min);
    2.0 * (N * N * N) as f64 / best / 1e9
}

/// Allocates the matrix product's per-thread packing buffer (gemm's `L2_SLAB`, the size of the L2
/// cache: 2 MiB on a recent Xeon) on every thread of the pool and on this one. Each is made the
/// first time its thread packs an operand and lives as long as the thread, like the model's
/// state; left to chance, it appears in whichever step first puts a product on that thread, and a
/// measured step peak is 2 MiB higher for no reason of its own. Measurements call this first.
pub fn allocate_matmul_workspaces() {
    let touch = |_| gemm_common::gemm::L2_SLAB.with(|_| ());
    touch(());
    rayon::broadcast(|_| touch(()));
}
