//! Fused training ops: each one candle custom op whose backward keeps only what it needs, where the
//! same op composed from elementwise candle ops keeps every intermediate alive until backward ends
//! (a composed LayerNorm holds 5 tensors of its input's size, a composed softmax 3, a composed
//! cross-entropy 3 of the logits' size).
//!
//! - [`layer_norm()`]: keeps nothing but its input (the statistics are recomputed in backward).
//! - [`softmax_last_dim()`]: with an optional scale and causal mask folded in, keeps only its
//!   output.
//! - [`cross_entropy()`]: the mean (optionally weighted) negative log-likelihood of logits; keeps
//!   nothing but its inputs.
//! - [`batch_norm_train()`]: BatchNorm in training mode, optionally with the ReLU that follows it;
//!   [`batch_norm_pair_train()`]: two BatchNorms added and a ReLU (a downsampling block's end);
//!   keeps its input and output (a composed BatchNorm + ReLU keeps 7 tensors of that size).
//! - [`dropout()`]: inverted dropout whose backward draws the mask again from its key instead of
//!   holding it; its bits equal `x * mask` composed.
//! - [`embedding()`]: a row lookup whose backward builds the table's gradient in one allocation.
//! - [`linear()`]: `x @ w + b` as one op, so the product before the bias is not kept.
//! - [`gelu()`]: tanh or erf GELU with a one-pass, multi-threaded backward.
//! - [`attention()`]: scaled dot-product attention with causal mask and dropout; keeps only q, k, v
//!   (scores and probabilities are rebuilt in backward).
//! - `max_pool2d`, `max_pool3d` (through the crate's `max_pool2d_k3s2p1` and `max_pool3d_k2s2`):
//!   keep only their input; backward finds each window's maximum again.
//! - `conv_transpose3d_k2s2` (through the crate's function of that name): the U-Net up-convolution
//!   with its bias, one matrix product per sample; its gradients by the direct kernels (a stride-2
//!   convolution of its output gradient); keeps only its input.
//! - `conv3d` (through the crate's `conv3d`): in f32 on AVX2 or AVX-512, direct convolution
//!   (output tiles in vector registers, every input channel and tap added in, oneDNN's way: the
//!   `conv3d::direct` module) for the forward and both gradients of every kernel but 1x1x1; a
//!   1x1x1 kernel, f64, or another processor, a matrix product per block of an operand matrix
//!   built in blocks (vol2col), built again in backward. Keeps its input and output only. Through
//!   `conv3d_concat`, of two tensors' channels side by side, never concatenated.
//! - The `composed` module: the same convolutions composed from candle ops, for any device.
//!
//! Every kernel of ours works row by row (or channel by channel), each sequentially on one thread,
//! and every reduction across rows sums fixed chunks in a fixed order: the same inputs give the
//! same bits whatever the number of threads; the direct convolutions make each output element in
//! one tile, its sum in one fixed order. The ops that multiply matrices (linear, attention,
//! conv3d where it is not direct) use candle's matrix product for that part, as the composed ops
//! do; in one process it gives the same bits every time, so a recompute under checkpointing is
//! bit-identical to the forward.
//!
//! f32 and f64 tensors on the CPU take the fused path, and so do bf16 and f16 ones: their kernels
//! read the half-precision operands widened to f32 (a transient copy per op), compute in f32 and
//! store results in the operands' dtype, so what an op keeps for backward stays in half precision
//! (candle's CPU backend has no bf16 matrix product at all). A half-precision activation may meet
//! f32 weights: each operand is read in its own dtype, and each gradient is made in its operand's
//! dtype, so f32 weights get f32 gradients. Cross-entropy returns an f32 loss.
//!
//! On a CUDA device every op takes its device-generic route (the `generic` module): the same op,
//! keeping the same tensors for backward, its forward and backward composed from candle's device
//! kernels inside the custom op. [`set_path`] forces that route on the CPU, where the tests prove
//! it. Anything else (Metal, integer tensors) falls back to the composed candle ops.

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Storage, Tensor, WithDType};
use num_traits::Float;
use rayon::prelude::*;
use std::borrow::Cow;

/// The storage `$body` makes, a `Vec` of f32 or f64 as `$s` holds (the element type is inferred
/// in each arm; half precision computes in f32 and is stored narrowed): the one dispatch every
/// fused op's forward needs.
macro_rules! per_float {
    ($s:expr, $name:literal, $body:expr) => {
        match $s {
            candle_core::CpuStorage::F32(_) => candle_core::CpuStorage::F32($body),
            candle_core::CpuStorage::F64(_) => candle_core::CpuStorage::F64($body),
            candle_core::CpuStorage::BF16(_) => {
                candle_core::CpuStorage::BF16($crate::fused::narrow($body))
            }
            candle_core::CpuStorage::F16(_) => {
                candle_core::CpuStorage::F16($crate::fused::narrow($body))
            }
            _ => candle_core::bail!(concat!("fused ", $name, ": float operands only")),
        }
    };
}

/// `$body` with the type `$t` set to f32 or f64 as `$dtype` says: the dispatch of the backward
/// passes and of the wrappers that read a tensor's elements.
macro_rules! per_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 | candle_core::DType::BF16 | candle_core::DType::F16 => {
                type $t = f32;
                $body
            }
            _ => {
                type $t = f64;
                $body
            }
        }
    };
}

/// Implements candle's `CustomOp1/2/3` for a [`FusedOp`], once per arity listed, each with the
/// name the op has at that arity: `custom_op!(LinearOp: 2 "fused-linear", 3 "fused-linear-bias");`.
/// Each impl sits in an anonymous const so that the `use`s it needs stay out of the caller's scope.
macro_rules! custom_op {
    ($op:ty: $($arity:tt $name:literal),+) => {
        $(custom_op!(@ $arity $op, $name);)+
    };
    (@ 1 $op:ty, $name:literal) => {
        const _: () = {
            use candle_core::{CpuStorage, Layout, Result, Shape, Tensor};
            use $crate::fused::{gradients, FusedOp};

            impl candle_core::CustomOp1 for $op {
                fn name(&self) -> &'static str {
                    $name
                }

                fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
                    FusedOp::cpu_fwd(self, &[(s, l)])
                }

                fn bwd(&self, x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
                    let [dx] = gradients(FusedOp::bwd(self, &[x], y, g)?, $name)?;
                    Ok(dx)
                }
            }
        };
    };
    (@ 2 $op:ty, $name:literal) => {
        const _: () = {
            use candle_core::{CpuStorage, Layout, Result, Shape, Tensor};
            use $crate::fused::{gradients, FusedOp};

            impl candle_core::CustomOp2 for $op {
                fn name(&self) -> &'static str {
                    $name
                }

                fn cpu_fwd(
                    &self,
                    s1: &CpuStorage,
                    l1: &Layout,
                    s2: &CpuStorage,
                    l2: &Layout,
                ) -> Result<(CpuStorage, Shape)> {
                    FusedOp::cpu_fwd(self, &[(s1, l1), (s2, l2)])
                }

                fn bwd(
                    &self,
                    x1: &Tensor,
                    x2: &Tensor,
                    y: &Tensor,
                    g: &Tensor,
                ) -> Result<(Option<Tensor>, Option<Tensor>)> {
                    let [d1, d2] = gradients(FusedOp::bwd(self, &[x1, x2], y, g)?, $name)?;
                    Ok((d1, d2))
                }
            }
        };
    };
    (@ 3 $op:ty, $name:literal) => {
        const _: () = {
            use candle_core::{CpuStorage, Layout, Result, Shape, Tensor};
            use $crate::fused::{gradients, FusedOp};

            impl candle_core::CustomOp3 for $op {
                fn name(&self) -> &'static str {
                    $name
                }

                fn cpu_fwd(
                    &self,
                    s1: &CpuStorage,
                    l1: &Layout,
                    s2: &CpuStorage,
                    l2: &Layout,
                    s3: &CpuStorage,
                    l3: &Layout,
                ) -> Result<(CpuStorage, Shape)> {
                    FusedOp::cpu_fwd(self, &[(s1, l1), (s2, l2), (s3, l3)])
                }

                fn bwd(
                    &self,
                    x1: &Tensor,
                    x2: &Tensor,
                    x3: &Tensor,
                    y: &Tensor,
                    g: &Tensor,
                ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
                    let [d1, d2, d3] = gradients(FusedOp::bwd(self, &[x1, x2, x3], y, g)?, $name)?;
                    Ok((d1, d2, d3))
                }
            }
        };
    };
}

// The op modules come after the macros: a `macro_rules!` is visible only below its definition.
mod attention;
mod batch_norm;
mod composed;
mod conv3d;
mod conv_transpose3d;
mod cross_entropy;
mod dropout;
mod embedding;
mod gelu;
mod generic;
mod layer_norm;
mod linear;
mod max_pool;
mod softmax;

pub use attention::attention;
pub use batch_norm::{batch_norm_pair_train, batch_norm_train, Normalised};
pub use composed::Conv3dGeometry;
pub(crate) use composed::{
    conv3d_composed, conv3d_composed_backward, conv_transpose3d_k2s2_composed,
};
#[cfg(test)] // src/conv3d.rs's tests force small blocks through it
pub(crate) use conv3d::conv3d_blocked;
pub(crate) use conv3d::{conv3d, conv3d_concat, conv3d_concat_generic, conv3d_generic};
pub(crate) use conv_transpose3d::{conv_transpose3d_k2s2, conv_transpose3d_k2s2_generic};
pub use cross_entropy::cross_entropy;
pub use dropout::dropout;
pub use embedding::embedding;
pub use gelu::gelu;
pub(crate) use generic::generic;
pub use generic::{path, set_path, Path};
pub use layer_norm::layer_norm;
pub use linear::{linear, lora_linear};
pub(crate) use max_pool::{max_pool2d, max_pool3d, max_pool_generic};
pub use softmax::softmax_last_dim;

/// One operand of a custom op's CPU forward: its storage and layout.
type Operand<'a> = (&'a CpuStorage, &'a Layout);

/// A fused op's CPU forward and backward over its operands in order, from which [`custom_op!`]
/// implements candle's `CustomOp1/2/3`: an op whose last operand is optional (BatchNorm's
/// residual, linear's bias) writes each once for both arities.
trait FusedOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)>;

    /// One gradient per input, `None` for an input that has none (class ids).
    fn bwd(&self, inputs: &[&Tensor], out: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>>;
}

/// `a op b`, or with `kept` (its output kept from the forward under selective recompute,
/// `remat::keep`) the op's replay: that output, with the op's backward.
fn apply2<O>(a: &Tensor, b: &Tensor, op: O, kept: Option<Tensor>) -> Result<Tensor>
where
    O: FusedOp + candle_core::CustomOp2 + Send + Sync + 'static,
    generic::Replay<O>: candle_core::CustomOp2 + Send + Sync + 'static,
{
    match kept {
        Some(y) => a.apply_op2(b, generic::Replay::new(op, y)),
        None => a.apply_op2(b, op),
    }
}

/// [`apply2`] of an op over three operands.
fn apply3<O>(a: &Tensor, b: &Tensor, c: &Tensor, op: O, kept: Option<Tensor>) -> Result<Tensor>
where
    O: FusedOp + candle_core::CustomOp3 + Send + Sync + 'static,
    generic::Replay<O>: candle_core::CustomOp3 + Send + Sync + 'static,
{
    match kept {
        Some(y) => a.apply_op3(b, c, generic::Replay::new(op, y)),
        None => a.apply_op3(b, c, op),
    }
}

/// The output an op computes with `compute`, or the one its forward kept (`kept`).
fn kept_or(kept: Option<Tensor>, compute: impl FnOnce() -> Result<Tensor>) -> Result<Tensor> {
    match kept {
        Some(y) => Ok(y),
        None => compute(),
    }
}

/// The operands of an op that takes exactly `N` (what [`custom_op!`] passes at arity `N`).
fn exactly<const N: usize, T: Copy>(inputs: &[T]) -> Result<[T; N]> {
    inputs.try_into().map_err(|_| {
        candle_core::Error::Msg(format!(
            "fused op: {} operands where {N} were expected",
            inputs.len()
        ))
    })
}

/// `FusedOp::bwd`'s gradients as the `N` that `CustomOpN::bwd` returns.
fn gradients<const N: usize>(
    grads: Vec<Option<Tensor>>,
    name: &str,
) -> Result<[Option<Tensor>; N]> {
    grads.try_into().map_err(|g: Vec<_>| {
        candle_core::Error::Msg(format!("{name}: {} gradients for {N} operands", g.len()))
    })
}

/// Rows per chunk of a cross-row reduction: fixed, so the summation order is too.
const CHUNK_ROWS: usize = 64;

/// Elements per parallel task of an elementwise op (dropout, GELU); a multiple of 2, so no dropout
/// task starts inside a stream word.
const ELEMENT_CHUNK: usize = 1 << 14;

/// The fused path applies: a float tensor on the CPU, the kernels not set aside ([`set_path`]).
pub fn fused(t: &Tensor) -> bool {
    path() == Path::Kernel
        && t.device().is_cpu()
        && matches!(t.dtype(), DType::F32 | DType::F64 | DType::BF16 | DType::F16)
}

/// The op's own implementation applies, the CPU kernel or the generic route, rather than candle's
/// composed ops.
pub(crate) fn lean(t: &Tensor) -> bool {
    fused(t) || generic(t)
}

/// `t` in f32 if it is in half precision, else as it is: for the composed ops that have no
/// half-precision path on the CPU (they then keep the f32 copy for backward).
pub fn widened(t: &Tensor) -> Result<Tensor> {
    widened_as(t, t)
}

/// `t` in the dtype an op on `x` computes in: f32 beside a half-precision `x`, else `x`'s dtype.
/// What the generic route reads an operand or a gradient as next to its input.
pub(crate) fn widened_as(t: &Tensor, x: &Tensor) -> Result<Tensor> {
    t.to_dtype(if is_half(x.dtype()) { DType::F32 } else { x.dtype() })
}

/// bf16 or f16: the kernels widen it to f32.
pub fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// `t` as a fused kernel reads it next to an input `x`: in `x`'s dtype, except beside a
/// half-precision `x`, where it stays as stored (an f32 weight is read as is, its gradient made in
/// f32, with no half-precision copy kept); contiguous.
fn operand(t: &Tensor, x: &Tensor) -> Result<Tensor> {
    if is_half(x.dtype()) {
        t.contiguous()
    } else {
        t.to_dtype(x.dtype())?.contiguous()
    }
}

/// The contiguous elements of a CPU storage as `T`: borrowed where it holds `T`, converted (a
/// copy) where it holds another float type (half precision widened to f32).
pub fn slice<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout) -> Result<Cow<'a, [T]>> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("fused op: input is not contiguous".into()))?;
    fn convert<S: WithDType, T: WithDType>(v: &[S]) -> Cow<'static, [T]> {
        Cow::Owned(v.iter().map(|x| T::from_f64(x.to_f64())).collect())
    }
    Ok(match s {
        CpuStorage::BF16(v) if T::DTYPE != DType::BF16 => convert(&v[start..end]),
        CpuStorage::F16(v) if T::DTYPE != DType::F16 => convert(&v[start..end]),
        CpuStorage::F32(v) if T::DTYPE != DType::F32 => convert(&v[start..end]),
        CpuStorage::F64(v) if T::DTYPE != DType::F64 => convert(&v[start..end]),
        _ => Cow::Borrowed(&s.as_slice::<T>()?[start..end]),
    })
}

/// A kernel's f32 result stored as the half-precision type `H`.
fn narrow<H: WithDType>(v: Vec<f32>) -> Vec<H> {
    v.into_iter().map(|x| H::from_f64(x as f64)).collect()
}

/// Runs `f` on the contiguous elements of a CPU tensor.
pub(crate) fn with_slice<T: WithDType, R>(
    t: &Tensor,
    f: impl FnOnce(&[T]) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => f(&slice::<T>(s, layout)?),
        _ => candle_core::bail!("fused op: tensor is not on the CPU"),
    }
}

/// A gradient's elements as a tensor shaped, placed and typed like `like`.
fn shaped<T: WithDType>(v: Vec<T>, like: &Tensor) -> Result<Tensor> {
    Tensor::from_vec(v, like.shape(), like.device())?.to_dtype(like.dtype())
}

/// A float type the kernels run in.
trait Elem:
    WithDType + Float + Send + Sync + std::iter::Sum + std::ops::AddAssign + std::ops::SubAssign
{
    /// `v` as f32 elements, where this type is f32: what the kernels written for f32 alone take.
    fn f32s(v: &[Self]) -> Option<&[f32]>;

    /// f32 elements as this type's, where it is f32.
    fn from_f32s(v: Vec<f32>) -> Option<Vec<Self>>;
}

impl Elem for f32 {
    fn f32s(v: &[f32]) -> Option<&[f32]> {
        Some(v)
    }

    fn from_f32s(v: Vec<f32>) -> Option<Vec<f32>> {
        Some(v)
    }
}

impl Elem for f64 {
    fn f32s(_: &[f64]) -> Option<&[f32]> {
        None
    }

    fn from_f32s(_: Vec<f32>) -> Option<Vec<f64>> {
        None
    }
}

fn elem<T: Elem>(x: f64) -> T {
    T::from(x).expect("a finite constant")
}

fn wide<T: Elem>(v: T) -> f64 {
    WithDType::to_f64(v)
}

/// The larger of `m` and `v`, NaN winning, as PyTorch's reductions: `Float::max` ignores a NaN,
/// so a NaN would vanish from a row's maximum (an all-NaN softmax row would come out as zeros).
fn nan_max<T: Elem>(m: T, v: T) -> T {
    if v.is_nan() || v > m {
        v
    } else {
        m
    }
}

/// The sum of `xs` as `LANES` interleaved partial sums added in order at the end: one fixed order,
/// which vectorises, where a single running sum waits for each addition in turn (the
/// up-convolution's bias gradient, summed so, took as long as its input gradient).
fn sum_lanes<T: Elem>(xs: &[T]) -> T {
    const LANES: usize = 16;
    let mut acc = [T::zero(); LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        acc.iter_mut().zip(chunk).for_each(|(a, &v)| *a += v);
    }
    acc.iter_mut().zip(rest).for_each(|(a, &v)| *a += v);
    acc.into_iter().fold(T::zero(), |s, a| s + a)
}

/// Sums `n_rows` rows' contributions of width `width` (from `row(i, out)`, which adds row i into
/// `out`) in fixed chunks of rows, the chunks' partial sums then added in order.
fn sum_rows<T: Elem>(n_rows: usize, width: usize, row: impl Fn(usize, &mut [T]) + Sync) -> Vec<T> {
    sum_chunks(n_rows, CHUNK_ROWS, width, row)
}

/// [`sum_rows`] in chunks of `chunk` rows: fixed by the caller, not by the threads, so the sums'
/// order is too.
fn sum_chunks<T: Elem>(
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

/// A matrix operand of [`matmul`]: row-major elements, stored transposed or not, its stored rows
/// `ld` elements apart (packed unless [`Mat::ld`] says otherwise: a block of a wider matrix).
#[derive(Clone, Copy)]
struct Mat<'a, T> {
    data: &'a [T],
    /// The stored matrix is the operand's transpose: (cols, rows) row-major.
    t: bool,
    ld: Option<usize>,
}

fn mat<T>(data: &[T], t: bool) -> Mat<'_, T> {
    Mat { data, t, ld: None }
}

impl<T> Mat<'_, T> {
    /// The operand's transpose (the same elements).
    fn transposed(self) -> Self {
        Mat { t: !self.t, ..self }
    }

    /// The stored rows are `ld` elements apart, not packed.
    fn ld(self, ld: usize) -> Self {
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

/// `dst (m, n) (+)= a (m, k) @ b (k, n)`: [`matmul_strided`] into a packed row-major `dst`.
fn matmul<T: Elem>(
    dst: &mut [T],
    a: Mat<T>,
    b: Mat<T>,
    mkn: (usize, usize, usize),
    accumulate: bool,
) {
    let threads = candle_core::utils::get_num_threads();
    matmul_on(threads, dst, (packed(dst, mkn), 1), a, b, mkn, accumulate)
}

/// [`matmul`] on this thread alone: for products that the caller runs side by side, each too
/// small to pay for splitting (a pointwise convolution's, one per sample).
fn matmul_alone<T: Elem>(
    dst: &mut [T],
    a: Mat<T>,
    b: Mat<T>,
    mkn: (usize, usize, usize),
    accumulate: bool,
) {
    matmul_on(1, dst, (packed(dst, mkn), 1), a, b, mkn, accumulate)
}

/// The row stride of `dst` packing an (m, n) product, checked.
fn packed<T>(dst: &[T], (m, _, n): (usize, usize, usize)) -> usize {
    assert!(dst.len() == m * n, "matmul: {} elements do not pack a ({m}, {n}) product", dst.len());
    n
}

/// `dst (m, n) (+)= a (m, k) @ b (k, n)` with gemm, the matrix product candle's CPU backend runs,
/// called directly: operands are read in place (a transposed operand or a block of a wider matrix
/// is a stride, not a copy) and the product is written into `dst` at (row, column) strides
/// `dst_strides` (added to it with `accumulate`; without, `dst` is only written, so it may be
/// uninitialised). Split over candle's threads; the bits do not depend on their number (threads
/// split the output, each element's sum over k runs in one fixed order).
fn matmul_strided<T: Elem>(
    dst: &mut [T],
    dst_strides: (usize, usize),
    a: Mat<T>,
    b: Mat<T>,
    mkn: (usize, usize, usize),
    accumulate: bool,
) {
    let threads = candle_core::utils::get_num_threads();
    matmul_on(threads, dst, dst_strides, a, b, mkn, accumulate)
}

/// [`matmul_strided`] split over `threads`.
fn matmul_on<T: Elem>(
    threads: usize,
    dst: &mut [T],
    (dst_rs, dst_cs): (usize, usize),
    a: Mat<T>,
    b: Mat<T>,
    (m, k, n): (usize, usize, usize),
    accumulate: bool,
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
            accumulate,
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
fn matmul_new<T: Elem>(a: Mat<T>, b: Mat<T>, mkn: (usize, usize, usize)) -> Vec<T> {
    // SAFETY: the product writes every element.
    let mut dst = unsafe { uninit(mkn.0 * mkn.2) };
    matmul(&mut dst, a, b, mkn, false);
    dst
}

/// A vector of `len` elements whose values are not set: for a buffer that a kernel writes in full
/// before anything reads it, where zero-filling would be one more pass over memory (and for a
/// fresh allocation, the pass that faults its pages in).
///
/// # Safety
/// Every element must be written before it is read.
#[allow(clippy::uninit_vec)]
unsafe fn uninit<T: Elem>(len: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(len);
    // SAFETY: the capacity is `len`; `T` is f32 or f64, which have no invalid bit patterns, and
    // the caller writes every element before reading it.
    unsafe { v.set_len(len) };
    v
}

/// `len` sums over `terms` terms whose first term writes them whole (so they need no zeros
/// first: see [`uninit`]); zeros where there is no term (an empty batch).
///
/// # Safety
/// With terms, the first must write every element before anything reads it.
unsafe fn sums<T: Elem>(len: usize, terms: usize) -> Vec<T> {
    match terms {
        0 => vec![T::zero(); len],
        // SAFETY: the caller's first term writes every element.
        _ => unsafe { uninit(len) },
    }
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
            matmul(&mut dst, mat(&a, false), mat(&a, true), (N, N, N), false);
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
