//! Fused training ops for the CPU: each one candle custom op whose backward keeps only what it
//! needs, where the same op composed from elementwise candle ops keeps every intermediate alive
//! until backward ends (a composed LayerNorm holds 5 tensors of its input's size, a composed
//! softmax 3, a composed cross-entropy 3 of the logits' size).
//!
//! - [`layer_norm`]: keeps nothing but its input (the statistics are recomputed in backward).
//! - [`softmax_last_dim`]: with an optional scale and causal mask folded in, keeps only its output.
//! - [`cross_entropy`]: the mean (optionally weighted) negative log-likelihood of logits; keeps
//!   nothing but its inputs.
//! - [`batch_norm_train`]: BatchNorm in training mode, optionally with the ReLU that follows it;
//!   keeps its input and output (a composed BatchNorm + ReLU keeps 7 tensors of that size).
//! - [`dropout`]: inverted dropout whose backward draws the mask again from its key instead of
//!   holding it; its bits equal `x * mask` composed.
//! - [`embedding`]: a row lookup whose backward builds the table's gradient in one allocation.
//! - [`linear`]: `x @ w + b` as one op, so the product before the bias is not kept.
//! - [`gelu`]: tanh or erf GELU with a one-pass, multi-threaded backward.
//! - [`attention`]: scaled dot-product attention with causal mask and dropout; keeps only q, k, v
//!   (scores and probabilities are rebuilt in backward).
//! - `max_pool2d` (through [`crate::max_pool2d_k3s2p1`]): keeps only its input; backward finds
//!   each window's maximum again.
//! - `conv_transpose3d_k2s2` (through [`crate::conv_transpose3d_k2s2`]): the U-Net up-convolution
//!   with its bias, one matrix product per sample; keeps only its input.
//! - `conv3d` (through [`crate::conv3d`]): vol2col in blocks and a matrix product per block, the
//!   column matrix built again in backward; keeps its input and output only.
//!
//! Every kernel of ours works row by row (or channel by channel), each sequentially on one
//! thread, and every reduction across rows sums fixed chunks in a fixed order: the same inputs
//! give the same bits whatever the number of threads. The ops that multiply matrices (linear,
//! attention, conv3d) use candle's matrix product for that part, as the composed ops do; in one
//! process it gives the same bits every time, so a recompute under checkpointing is bit-identical
//! to the forward.
//!
//! f32 and f64 tensors on the CPU take the fused path, and so do bf16 and f16 ones: their kernels
//! read the half-precision operands widened to f32 (a transient copy per op), compute in f32 and
//! store results in the operands' dtype, so what an op keeps for backward stays in half precision
//! (candle's CPU backend has no bf16 matrix product at all). A half-precision activation may meet
//! f32 weights: each operand is read in its own dtype, and each gradient is made in its operand's
//! dtype, so f32 weights get f32 gradients. Cross-entropy returns an f32 loss. Anything else (a
//! GPU) falls back to the composed candle ops, which are correct everywhere.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor, WithDType, D};
use num_traits::Float;
use rayon::prelude::*;
use remat::rng::RngKey;
use std::borrow::Cow;

/// Rows per chunk of a cross-row reduction: fixed, so the summation order is too.
const CHUNK_ROWS: usize = 64;

/// The fused path applies: a float tensor on the CPU.
pub(crate) fn fused(t: &Tensor) -> bool {
    t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::F64 | DType::BF16 | DType::F16)
}

/// `t` in f32 if it is in half precision, else as it is: for the composed ops that have no
/// half-precision path on the CPU (they then keep the f32 copy for backward).
pub fn widened(t: &Tensor) -> Result<Tensor> {
    if is_half(t.dtype()) {
        t.to_dtype(DType::F32)
    } else {
        Ok(t.clone())
    }
}

/// bf16 or f16: the kernels widen it to f32.
pub(crate) fn is_half(dtype: DType) -> bool {
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
pub(crate) fn slice<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout) -> Result<Cow<'a, [T]>> {
    let (start, end) = l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("fused op: input is not contiguous".into()))?;
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
pub(crate) fn with_slice<T: WithDType, R>(t: &Tensor, f: impl FnOnce(&[T]) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => f(&slice::<T>(s, layout)?),
        _ => candle_core::bail!("fused op: tensor is not on the CPU"),
    }
}

/// The storage `$body` makes, a `Vec` of f32 or f64 as `$s` holds (the element type is inferred
/// in each arm; half precision computes in f32 and is stored narrowed): the one dispatch every
/// fused op's forward needs.
macro_rules! per_float {
    ($s:expr, $name:literal, $body:expr) => {
        match $s {
            CpuStorage::F32(_) => CpuStorage::F32($body),
            CpuStorage::F64(_) => CpuStorage::F64($body),
            CpuStorage::BF16(_) => CpuStorage::BF16(narrow($body)),
            CpuStorage::F16(_) => CpuStorage::F16(narrow($body)),
            _ => candle_core::bail!(concat!("fused ", $name, ": float operands only")),
        }
    };
}

/// `$body` with the type `$t` set to f32 or f64 as `$dtype` says: the dispatch of the backward
/// passes and of the wrappers that read a tensor's elements.
macro_rules! per_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            DType::F32 | DType::BF16 | DType::F16 => {
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

/// A gradient's elements as a tensor shaped, placed and typed like `like`.
fn shaped<T: WithDType>(v: Vec<T>, like: &Tensor) -> Result<Tensor> {
    Tensor::from_vec(v, like.shape(), like.device())?.to_dtype(like.dtype())
}

/// A float type the kernels run in.
trait Elem: WithDType + Float + Send + Sync + std::iter::Sum + std::ops::AddAssign + std::ops::SubAssign {}
impl Elem for f32 {}
impl Elem for f64 {}

fn elem<T: Elem>(x: f64) -> T {
    T::from(x).expect("a finite constant")
}

fn wide<T: Elem>(v: T) -> f64 {
    WithDType::to_f64(v)
}

/// The larger of `m` and `v`, NaN winning, as PyTorch's reductions: `Float::max` ignores a NaN,
/// which let a NaN vanish from a row's maximum (an all-NaN softmax row came out as zeros).
fn nan_max<T: Elem>(m: T, v: T) -> T {
    if v.is_nan() || v > m {
        v
    } else {
        m
    }
}

/// Sums `n_rows` rows' contributions of width `width` (from `row(i, out)`, which adds row i into
/// `out`) in fixed chunks of rows, the chunks' partial sums then added in order.
fn sum_rows<T: Elem>(n_rows: usize, width: usize, row: impl Fn(usize, &mut [T]) + Sync) -> Vec<T> {
    let partials: Vec<Vec<T>> = (0..n_rows.div_ceil(CHUNK_ROWS))
        .into_par_iter()
        .map(|c| {
            let mut acc = vec![T::zero(); width];
            (c * CHUNK_ROWS..((c + 1) * CHUNK_ROWS).min(n_rows)).for_each(|i| row(i, &mut acc));
            acc
        })
        .collect();
    let mut total = vec![T::zero(); width];
    for p in partials {
        total.iter_mut().zip(p).for_each(|(t, v)| *t += v);
    }
    total
}

// ---------------------------------------------------------------------------------------------
// LayerNorm

/// Layer normalisation over the last dimension: `(x - mean) / sqrt(var + eps) * weight + bias`,
/// with the biased variance, as PyTorch's `layer_norm`.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    if !fused(x) {
        return candle_nn::ops::layer_norm_slow(x, weight, bias, eps as f32);
    }
    let d = x.dim(D::Minus1)?;
    if weight.dims() != [d] || bias.dims() != [d] {
        candle_core::bail!("layer_norm: weight {:?} and bias {:?} must be [{d}]", weight.dims(), bias.dims())
    }
    x.contiguous()?.apply_op3(&operand(weight, x)?, &operand(bias, x)?, LayerNormOp { eps })
}

struct LayerNormOp {
    eps: f64,
}

/// Mean and 1/sqrt(var + eps) of one row (two passes: the mean, then the centred squares).
fn row_stats<T: Elem>(row: &[T], eps: f64) -> (T, T) {
    let n = elem::<T>(row.len() as f64);
    let mean = row.iter().copied().sum::<T>() / n;
    let var = row.iter().map(|&v| (v - mean) * (v - mean)).sum::<T>() / n;
    (mean, T::one() / (var + elem(eps)).sqrt())
}

impl LayerNormOp {
    fn forward<T: Elem>(&self, x: &[T], w: &[T], b: &[T]) -> Vec<T> {
        let mut y = vec![T::zero(); x.len()];
        y.par_chunks_mut(w.len()).zip(x.par_chunks(w.len())).for_each(|(y, x)| {
            let (mean, rstd) = row_stats(x, self.eps);
            for j in 0..x.len() {
                y[j] = (x[j] - mean) * rstd * w[j] + b[j];
            }
        });
        y
    }

    /// dx = rstd (g w - mean(g w) - x_hat mean(g w x_hat)); dw = sum over rows of g x_hat; db =
    /// sum over rows of g.
    fn backward<T: Elem>(&self, x: &[T], w: &[T], g: &[T]) -> (Vec<T>, Vec<T>, Vec<T>) {
        let d = w.len();
        let mut dx = vec![T::zero(); x.len()];
        dx.par_chunks_mut(d).zip(x.par_chunks(d).zip(g.par_chunks(d))).for_each(|(dx, (x, g))| {
            let (mean, rstd) = row_stats(x, self.eps);
            let n = elem::<T>(d as f64);
            let (mut m1, mut m2) = (T::zero(), T::zero());
            for j in 0..d {
                let gw = g[j] * w[j];
                m1 += gw;
                m2 += gw * (x[j] - mean) * rstd;
            }
            let (m1, m2) = (m1 / n, m2 / n);
            for j in 0..d {
                dx[j] = rstd * (g[j] * w[j] - m1 - (x[j] - mean) * rstd * m2);
            }
        });
        let sums = sum_rows::<T>(x.len() / d, 2 * d, |i, acc| {
            let (x, g) = (&x[i * d..(i + 1) * d], &g[i * d..(i + 1) * d]);
            let (mean, rstd) = row_stats(x, self.eps);
            for j in 0..d {
                acc[j] += g[j] * (x[j] - mean) * rstd;
                acc[d + j] += g[j];
            }
        });
        (dx, sums[..d].to_vec(), sums[d..].to_vec())
    }
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "fused-layer-norm"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> Result<(CpuStorage, Shape)> {
        let y = per_float!(s1, "layer_norm", self.forward(&slice(s1, l1)?, &slice(s2, l2)?, &slice(s3, l3)?));
        Ok((y, l1.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _b: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let (dx, dw, db) = per_dtype!(x.dtype(), T => {
            let (dx, dw, db) = with_slice::<T, _>(x, |xs| with_slice(w, |ws| with_slice(&g, |gs| Ok(self.backward(xs, ws, gs)))))?;
            (shaped(dx, x)?, shaped(dw, w)?, shaped(db, w)?)
        });
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

// ---------------------------------------------------------------------------------------------
// Softmax

/// `softmax(scale * x)` over the last dimension; with `causal`, element (.., i, j) of the last two
/// dimensions is masked out (probability 0) where j > i, as in a decoder's self-attention.
pub fn softmax_last_dim(x: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    if !fused(x) {
        let x = (x * scale)?;
        let x = if causal {
            let (t, s) = (x.dim(D::Minus2)?, x.dim(D::Minus1)?);
            let future = Tensor::from_vec((0..t * s).map(|i| u8::from(i % s > i / s)).collect(), (t, s), x.device())?;
            let neg_inf = Tensor::new(f32::NEG_INFINITY, x.device())?.to_dtype(x.dtype())?.broadcast_as(x.shape())?;
            future.broadcast_as(x.shape())?.where_cond(&neg_inf, &x)?
        } else {
            x
        };
        return candle_nn::ops::softmax(&x, D::Minus1); // candle's fused softmax_last_dim has no backward
    }
    let rows_per_block = if causal { x.dim(D::Minus2)? } else { 1 };
    x.contiguous()?.apply_op1(SoftmaxOp { scale, causal, rows_per_block, padding: None })
}

struct SoftmaxOp {
    scale: f64,
    causal: bool,
    /// With `causal`, the number of rows of each (T, S) attention map: row r is query r % T.
    rows_per_block: usize,
    /// Key padding: which of each batch element's S keys may be attended to, (B, S) flat, and
    /// the rows per batch element (heads x T). A row with no key left is all zeros.
    padding: Option<(std::sync::Arc<Vec<bool>>, usize)>,
}

impl SoftmaxOp {
    /// How many leading entries of row `r` are visible.
    fn visible(&self, r: usize, width: usize) -> usize {
        if self.causal {
            (r % self.rows_per_block + 1).min(width)
        } else {
            width
        }
    }

    /// Whether entry `j` of row `r` (of `width`) takes part: visible and not padding.
    fn keeps(&self, r: usize, width: usize) -> impl Fn(usize) -> bool + '_ {
        let n = self.visible(r, width);
        let keys = self.padding.as_ref().map(|(keep, rows)| &keep[r / rows * width..(r / rows + 1) * width]);
        move |j| j < n && keys.is_none_or(|k| k[j])
    }

    fn forward<T: Elem>(&self, x: &[T], width: usize) -> Vec<T> {
        let scale = elem::<T>(self.scale);
        let mut y = vec![T::zero(); x.len()];
        y.par_chunks_mut(width).zip(x.par_chunks(width)).enumerate().for_each(|(r, (y, x))| {
            let (n, keep) = (self.visible(r, width), self.keeps(r, width));
            let max = (0..n).filter(|&j| keep(j)).fold(T::neg_infinity(), |m, j| nan_max(m, x[j] * scale));
            if max == T::neg_infinity() {
                return; // every key masked: the row stays zero
            }
            let mut sum = T::zero();
            for j in (0..n).filter(|&j| keep(j)) {
                y[j] = (x[j] * scale - max).exp();
                sum += y[j];
            }
            y[..n].iter_mut().for_each(|v| *v /= sum);
        });
        y
    }

    /// dx = scale * y * (g - sum(g y)) per row (masked entries have y = 0, so dx = 0 there).
    fn backward<T: Elem>(&self, y: &[T], g: &[T], width: usize) -> Vec<T> {
        let scale = elem::<T>(self.scale);
        let mut dx = vec![T::zero(); y.len()];
        dx.par_chunks_mut(width).zip(y.par_chunks(width).zip(g.par_chunks(width))).enumerate().for_each(|(r, (dx, (y, g)))| {
            let (n, keep) = (self.visible(r, width), self.keeps(r, width));
            let dot = (0..n).filter(|&j| keep(j)).map(|j| g[j] * y[j]).sum::<T>();
            for j in (0..n).filter(|&j| keep(j)) {
                dx[j] = scale * y[j] * (g[j] - dot);
            }
        });
        dx
    }
}

impl CustomOp1 for SoftmaxOp {
    fn name(&self) -> &'static str {
        "fused-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let width = l.dims().last().copied().unwrap_or(1);
        let y = per_float!(s, "softmax", self.forward(&slice(s, l)?, width));
        Ok((y, l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let (g, width) = (g.contiguous()?, y.dim(D::Minus1)?);
        let dx = per_dtype!(y.dtype(), T => shaped(with_slice::<T, _>(y, |ys| with_slice(&g, |gs| Ok(self.backward(ys, gs, width))))?, y)?);
        Ok(Some(dx))
    }
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy

/// Cross-entropy of logits (N, V) against class ids (N) u32: the mean over rows of
/// `logsumexp(row) - row[target]`, or with `weights` (N) the weighted mean
/// `sum(w_i ce_i) / sum(w_i)` (BERT scores only its masked positions). Weights that are all zero
/// are an error ([`NO_WEIGHT`]).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor, weights: Option<&Tensor>) -> Result<Tensor> {
    let (n, _) = logits.dims2()?;
    let weights = match weights {
        Some(w) => w.to_dtype(logits.dtype())?,
        None => Tensor::ones(n, logits.dtype(), logits.device())?,
    };
    if !fused(logits) {
        let logp = candle_nn::ops::log_softmax(logits, D::Minus1)?;
        let picked = logp.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)?;
        let total = weights.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        if total == 0.0 {
            candle_core::bail!("{NO_WEIGHT}")
        }
        return ((picked * &weights)?.sum_all()? / total)?.neg();
    }
    logits.contiguous()?.apply_op3(&targets.to_dtype(DType::U32)?.contiguous()?, &weights.contiguous()?, CrossEntropyOp)
}

struct CrossEntropyOp;

/// The error of a weighted cross-entropy whose weights are all zero. PyTorch returns NaN (a mean
/// over no target), which then reads as a diverged run; here it is refused, naming the cause.
const NO_WEIGHT: &str = "cross_entropy: every weight is zero, so the batch has no position to score (the mean over none is undefined)";

/// logsumexp of a row.
fn log_sum_exp<T: Elem>(row: &[T]) -> T {
    let max = row.iter().fold(T::neg_infinity(), |m, &v| nan_max(m, v));
    max + row.iter().map(|&v| (v - max).exp()).sum::<T>().ln()
}

impl CrossEntropyOp {
    fn forward<T: Elem>(logits: &[T], targets: &[u32], weights: &[T]) -> Result<T> {
        let v = logits.len() / targets.len();
        if let Some(&bad) = targets.iter().find(|&&t| t as usize >= v) {
            candle_core::bail!("cross_entropy: target {bad} is outside the {v} classes")
        }
        let weight = weights.iter().copied().sum::<T>();
        if weight == T::zero() {
            candle_core::bail!("{NO_WEIGHT}")
        }
        let losses: Vec<T> = logits.par_chunks(v).zip(targets.par_iter()).map(|(row, &t)| log_sum_exp(row) - row[t as usize]).collect();
        let total = losses.iter().zip(weights).fold(T::zero(), |acc, (&l, &w)| acc + l * w);
        Ok(total / weight)
    }

    /// d/dlogits = g w_i / sum(w) (softmax(row) - onehot(target)).
    fn backward<T: Elem>(logits: &[T], targets: &[u32], weights: &[T], g: T) -> Vec<T> {
        let v = logits.len() / targets.len();
        let scale = g / weights.iter().copied().sum::<T>();
        let mut d = vec![T::zero(); logits.len()];
        d.par_chunks_mut(v).zip(logits.par_chunks(v)).zip(targets.par_iter().zip(weights.par_iter())).for_each(|((d, row), (&t, &w))| {
            let lse = log_sum_exp(row);
            let s = scale * w;
            for j in 0..v {
                d[j] = s * (row[j] - lse).exp();
            }
            d[t as usize] -= s;
        });
        d
    }
}

impl CustomOp3 for CrossEntropyOp {
    fn name(&self) -> &'static str {
        "fused-cross-entropy"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> Result<(CpuStorage, Shape)> {
        let targets = slice::<u32>(s2, l2)?;
        let loss = match s1 {
            // The loss of half-precision logits is computed and returned in f32.
            CpuStorage::BF16(_) | CpuStorage::F16(_) => CpuStorage::F32(vec![Self::forward::<f32>(&slice(s1, l1)?, &targets, &slice(s3, l3)?)?]),
            _ => per_float!(s1, "cross_entropy", vec![Self::forward(&slice(s1, l1)?, &targets, &slice(s3, l3)?)?]),
        };
        Ok((loss, Shape::from(())))
    }

    fn bwd(&self, logits: &Tensor, targets: &Tensor, weights: &Tensor, _loss: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = g.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let d = with_slice::<u32, _>(
            targets,
            |t| per_dtype!(logits.dtype(), T => shaped(with_slice::<T, _>(logits, |l| with_slice(weights, |w| Ok(Self::backward(l, t, w, elem::<T>(g)))))?, logits)),
        )?;
        Ok((Some(d), None, None))
    }
}

// ---------------------------------------------------------------------------------------------
// BatchNorm (training mode)

/// BatchNorm of x (N, C, *spatial) with the batch's statistics, as PyTorch's training mode:
/// `(x - mean_c) / sqrt(var_c + eps) * weight_c + bias_c` with the biased variance, then
/// `+ residual` if given (same shape as x), then a ReLU if `relu` (a ResNet block's end:
/// `relu(bn(conv(h)) + identity)` as one op, which keeps only x and the output where the composed
/// version keeps the normalised tensor and the sum as well). Returns the output and the batch's
/// per-channel mean and biased variance (for the running statistics). CPU f32/f64 only: check
/// [`fused`] first.
pub fn batch_norm_train(x: &Tensor, weight: &Tensor, bias: &Tensor, residual: Option<&Tensor>, eps: f64, relu: bool) -> Result<(Tensor, Vec<f64>, Vec<f64>)> {
    let x = x.contiguous()?;
    let (n, c) = (x.dim(0)?, x.dim(1)?);
    let spatial = x.elem_count() / (n * c).max(1);
    let (mean, var) = per_dtype!(x.dtype(), T => with_slice::<T, _>(&x, |xs| Ok(channel_stats(xs, c, spatial)))?);
    let rstd = var.iter().map(|v| 1.0 / (v + eps).sqrt()).collect();
    let op = BatchNormOp { mean: mean.clone(), rstd, relu, channels: c, spatial };
    // Weight and bias travel as one (2, C) operand so that the residual fits a three-input op.
    let wb = operand(&Tensor::stack(&[weight, bias], 0)?, &x)?;
    let y = match residual {
        Some(r) => {
            if r.shape() != x.shape() {
                candle_core::bail!("batch_norm: residual {:?} does not match the input {:?}", r.dims(), x.dims())
            }
            x.apply_op3(&wb, &r.to_dtype(x.dtype())?.contiguous()?, op)?
        }
        None => x.apply_op2(&wb, op)?,
    };
    Ok((y, mean, var))
}

/// Per-channel mean and biased variance of (N, C, S) data, in f64, two passes; one channel per
/// task, each summed in a fixed order.
fn channel_stats<T: Elem>(x: &[T], c: usize, s: usize) -> (Vec<f64>, Vec<f64>) {
    let n = x.len() / (c * s);
    let m = (n * s) as f64;
    let values = |ch: usize| (0..n).flat_map(move |b| x[(b * c + ch) * s..(b * c + ch + 1) * s].iter().map(|&v| wide(v)));
    (0..c)
        .into_par_iter()
        .map(|ch| {
            let mean = values(ch).sum::<f64>() / m;
            (mean, values(ch).map(|v| (v - mean) * (v - mean)).sum::<f64>() / m)
        })
        .unzip()
}

struct BatchNormOp {
    mean: Vec<f64>,
    rstd: Vec<f64>,
    relu: bool,
    channels: usize,
    spatial: usize,
}

impl BatchNormOp {
    /// `wb` is (2, C): weight then bias.
    fn forward<T: Elem>(&self, x: &[T], wb: &[T], residual: Option<&[T]>) -> Vec<T> {
        let (w, b) = wb.split_at(self.channels);
        let mut y = vec![T::zero(); x.len()];
        y.par_chunks_mut(self.spatial).zip(x.par_chunks(self.spatial)).enumerate().for_each(|(i, (y, x))| {
            let ch = i % self.channels;
            let (mean, scale) = (elem::<T>(self.mean[ch]), elem::<T>(self.rstd[ch]) * w[ch]);
            let r = residual.map(|r| &r[i * self.spatial..(i + 1) * self.spatial]);
            for (j, (y, &x)) in y.iter_mut().zip(x).enumerate() {
                let mut v = (x - mean) * scale + b[ch];
                if let Some(r) = r {
                    v += r[j];
                }
                // A NaN stays NaN through the ReLU, as in PyTorch (`Float::max` made it 0, and
                // a NaN input trained on with a finite loss).
                *y = if self.relu && !v.is_nan() { Float::max(v, T::zero()) } else { v };
            }
        });
        y
    }

    /// With g' = g (masked by y > 0 after a ReLU) and x_hat the normalised input, per channel:
    /// db = sum g', dw = sum g' x_hat, dx = w rstd / M (M g' - db - x_hat dw); the residual's
    /// gradient is g'. Returns dx, d(weight, bias) as (2, C), and g' (None without a residual).
    fn backward<T: Elem>(&self, x: &[T], y: &[T], wb: &[T], g: &[T], residual: bool) -> (Vec<T>, Vec<T>, Option<Vec<T>>) {
        let (c, s) = (self.channels, self.spatial);
        let n = x.len() / (c * s);
        let grad = |i: usize| if self.relu && y[i] <= T::zero() { 0.0 } else { wide(g[i]) };
        let (db, dw): (Vec<f64>, Vec<f64>) = (0..c)
            .into_par_iter()
            .map(|ch| {
                let (mut db, mut dw) = (0f64, 0f64);
                for bi in 0..n {
                    let at = (bi * c + ch) * s;
                    for (i, &xi) in x[at..at + s].iter().enumerate() {
                        let gi = grad(at + i);
                        db += gi;
                        dw += gi * (wide(xi) - self.mean[ch]) * self.rstd[ch];
                    }
                }
                (db, dw)
            })
            .unzip();
        let m = (n * s) as f64;
        let mut dx = vec![T::zero(); x.len()];
        dx.par_chunks_mut(s).enumerate().for_each(|(block, dx)| {
            let ch = block % c;
            let k = wide(wb[ch]) * self.rstd[ch] / m;
            for (j, d) in dx.iter_mut().enumerate() {
                let i = block * s + j;
                let x_hat = (wide(x[i]) - self.mean[ch]) * self.rstd[ch];
                *d = elem(k * (m * grad(i) - db[ch] - x_hat * dw[ch]));
            }
        });
        let dr = residual.then(|| {
            let mut dr = vec![T::zero(); x.len()];
            dr.par_chunks_mut(s).enumerate().for_each(|(block, dr)| dr.iter_mut().enumerate().for_each(|(j, d)| *d = elem(grad(block * s + j))));
            dr
        });
        let dwb = dw.into_iter().chain(db).map(elem::<T>).collect();
        (dx, dwb, dr)
    }

    fn cpu_fwd(&self, x: (&CpuStorage, &Layout), wb: (&CpuStorage, &Layout), r: Option<(&CpuStorage, &Layout)>) -> Result<(CpuStorage, Shape)> {
        let y = per_float!(x.0, "batch_norm", self.forward(&slice(x.0, x.1)?, &slice(wb.0, wb.1)?, r.map(|(s, l)| slice(s, l)).transpose()?.as_deref()));
        Ok((y, x.1.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, wb: &Tensor, y: &Tensor, g: &Tensor, residual: bool) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let g = g.contiguous()?;
        Ok(per_dtype!(x.dtype(), T => {
            let (dx, dwb, dr) = with_slice::<T, _>(x, |xs| with_slice(y, |ys| with_slice(wb, |ws| with_slice(&g, |gs| Ok(self.backward(xs, ys, ws, gs, residual))))))?;
            (shaped(dx, x)?, shaped(dwb, wb)?, dr.map(|dr| shaped(dr, x)).transpose()?)
        }))
    }
}

impl CustomOp2 for BatchNormOp {
    fn name(&self) -> &'static str {
        "fused-batch-norm"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        BatchNormOp::cpu_fwd(self, (s1, l1), (s2, l2), None)
    }

    fn bwd(&self, x: &Tensor, wb: &Tensor, y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dwb, _) = BatchNormOp::bwd(self, x, wb, y, g, false)?;
        Ok((Some(dx), Some(dwb)))
    }
}

impl CustomOp3 for BatchNormOp {
    fn name(&self) -> &'static str {
        "fused-batch-norm-add"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> Result<(CpuStorage, Shape)> {
        BatchNormOp::cpu_fwd(self, (s1, l1), (s2, l2), Some((s3, l3)))
    }

    fn bwd(&self, x: &Tensor, wb: &Tensor, _r: &Tensor, y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dwb, dr) = BatchNormOp::bwd(self, x, wb, y, g, true)?;
        Ok((Some(dx), Some(dwb), dr))
    }
}

// ---------------------------------------------------------------------------------------------
// Dropout

/// Elements per parallel task of an elementwise op; for dropout a multiple of 2, so no task
/// starts inside a stream word.
const DROPOUT_CHUNK: usize = 1 << 14;

/// Inverted dropout: `x * mask` with `mask = 1 / (1 - p)` where `key`'s uniform draw is below
/// `1 - p`, else 0 (`RngKey::dropout_mask`). Backward draws the mask again from the key.
pub fn dropout(x: &Tensor, key: RngKey, p: f32) -> Result<Tensor> {
    if !fused(x) {
        let mask = Tensor::from_vec(key.dropout_mask(x.elem_count(), p), x.shape(), x.device())?.to_dtype(x.dtype())?;
        return x * mask;
    }
    x.contiguous()?.apply_op1(DropoutOp { key, p })
}

struct DropoutOp {
    key: RngKey,
    p: f32,
}

impl DropoutOp {
    /// `x * mask`, element by element, the mask drawn in parallel pieces of the key's stream.
    fn masked<T: Elem>(&self, x: &[T]) -> Vec<T> {
        let mut y = x.to_vec();
        self.mask_in_place(&mut y);
        y
    }

    fn mask_in_place<T: Elem>(&self, x: &mut [T]) {
        let keep = 1.0 - self.p;
        let scale = elem::<T>((1.0 / keep) as f64);
        x.par_chunks_mut(DROPOUT_CHUNK).enumerate().for_each(|(c, x)| {
            let mut u = vec![0f32; x.len()];
            self.key.uniform_into(c * DROPOUT_CHUNK, &mut u);
            for (x, &u) in x.iter_mut().zip(&u) {
                *x *= if u < keep { scale } else { T::zero() };
            }
        });
    }
}

impl CustomOp1 for DropoutOp {
    fn name(&self) -> &'static str {
        "fused-dropout"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let y = per_float!(s, "dropout", self.masked(&slice(s, l)?));
        Ok((y, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let g = g.contiguous()?;
        let dx = per_dtype!(x.dtype(), T => shaped(with_slice::<T, _>(&g, |gs| Ok(self.masked(gs)))?, x)?);
        Ok(Some(dx))
    }
}

// ---------------------------------------------------------------------------------------------
// 3D convolution

/// 3D convolution of x (N, C, D, H, W) with w (O, C, kd, kh, kw) by vol2col and a matrix product
/// per block of the column matrix (8 MB in f32 at most). It keeps nothing but its input and
/// output: the column matrix is built again in backward (the composed version in `conv3d.rs`
/// keeps 7 copies of its input).
pub(crate) fn conv3d(x: &Tensor, w: &Tensor, g: crate::Conv3dGeometry) -> Result<Tensor> {
    conv3d_blocked(x, w, g, 1 << 21)
}

/// [`conv3d`] building the column matrix in blocks of at most about `block_entries` entries (at
/// least one output row; see `Conv3dShape::blocks`).
pub(crate) fn conv3d_blocked(x: &Tensor, w: &Tensor, g: crate::Conv3dGeometry, block_entries: usize) -> Result<Tensor> {
    let shape = Conv3dShape::new(x.dims5()?, w.dims5()?, g, block_entries)?;
    x.contiguous()?.apply_op2(&operand(w, x)?, Conv3dOp { shape })
}

/// The sizes of one 3D convolution.
#[derive(Clone, Copy, Debug)]
struct Conv3dShape {
    n: usize,
    c: usize,
    o: usize,
    input: [usize; 3],
    kernel: [usize; 3],
    stride: [usize; 3],
    pad: [usize; 3],
    output: [usize; 3],
    block_entries: usize,
}

impl Conv3dShape {
    fn new(
        (n, c, d, h, w): (usize, usize, usize, usize, usize),
        (o, c_w, kd, kh, kw): (usize, usize, usize, usize, usize),
        g: crate::Conv3dGeometry,
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
                candle_core::bail!("conv3d: input {input:?} padded by {pad:?} is smaller than the kernel {kernel:?}")
            }
            output[a] = (input[a] + 2 * pad[a] - kernel[a]) / stride[a] + 1;
        }
        Ok(Conv3dShape { n, c, o, input, kernel, stride, pad, output, block_entries })
    }

    /// Rows of the column matrix (C kd kh kw) and its columns (output voxels).
    fn rows(&self) -> usize {
        self.c * self.kernel.iter().product::<usize>()
    }

    fn cols(&self) -> usize {
        self.output.iter().product()
    }

    fn volume(&self) -> usize {
        self.input.iter().product()
    }

    /// For row r = (c, a, p, q) of the column matrix and output coordinate `out` along axis
    /// `axis`, the input coordinate it reads, if inside the input.
    fn source(&self, axis: usize, out: usize, k: usize) -> Option<usize> {
        (out * self.stride[axis] + k).checked_sub(self.pad[axis]).filter(|&v| v < self.input[axis])
    }

    /// The blocks of the column matrix, in order, each at most about `block_entries` entries
    /// (at least one output row): whole samples side by side while a sample fits (a layer with few
    /// output voxels per sample still gets one wide matrix product), else one sample's output
    /// depth slices in runs, else one depth slice's output rows in runs.
    fn blocks(&self) -> Vec<ConvBlock> {
        let [depth, oh, ow] = self.output;
        let (per_row, n) = (self.rows() * ow, self.n);
        let fit = |unit: usize, max: usize| (self.block_entries / unit.max(1)).clamp(1, max);
        let (rows, slices) = (fit(per_row, oh), fit(per_row * oh, depth));
        if rows < oh {
            let runs = move |z: usize| (0..oh).step_by(rows).map(move |i| (z..z + 1, i..(i + rows).min(oh)));
            return (0..n).flat_map(|s| (0..depth).flat_map(runs).map(move |(zs, is)| ConvBlock { samples: s..s + 1, zs, rows: is })).collect();
        }
        if slices < depth {
            return (0..n)
                .flat_map(|s| (0..depth).step_by(slices).map(move |z| ConvBlock { samples: s..s + 1, zs: z..(z + slices).min(depth), rows: 0..oh }))
                .collect();
        }
        let samples = fit(per_row * oh * depth, n);
        (0..n).step_by(samples).map(|s| ConvBlock { samples: s..(s + samples).min(n), zs: 0..depth, rows: 0..oh }).collect()
    }

    /// Calls `f(column, input index, n)` for every run of row `r` of the column matrix of block
    /// `b` (one sample's part) that reads the input: columns `column..column + n` read the input
    /// at `index`, `index + s`, ... with `s` the width stride. Columns count from the block's start.
    fn for_row(&self, r: usize, b: &ConvBlock, mut f: impl FnMut(usize, usize, usize)) {
        let [kd, kh, kw] = self.kernel;
        let [d, h, w] = self.input;
        let [_, _, ow] = self.output;
        let (c, a, p, q) = (r / (kd * kh * kw), (r / (kh * kw)) % kd, (r / kw) % kh, r % kw);
        // The output columns j whose input column j s + q - pad lies inside the row.
        let (s, pad) = (self.stride[2], self.pad[2]);
        let j_lo = pad.saturating_sub(q).div_ceil(s);
        let j_hi = ((w + pad).saturating_sub(q)).div_ceil(s).min(ow);
        if j_lo >= j_hi {
            return;
        }
        for z in b.zs.clone() {
            let Some(zz) = self.source(0, z, a) else { continue };
            for i in b.rows.clone() {
                let Some(ii) = self.source(1, i, p) else { continue };
                let column = ((z - b.zs.start) * b.rows.len() + i - b.rows.start) * ow + j_lo;
                f(column, ((c * d + zz) * h + ii) * w + j_lo * s + q - pad, j_hi - j_lo);
            }
        }
    }

    /// Columns per sample in block `b`.
    fn block_len(&self, b: &ConvBlock) -> usize {
        b.zs.len() * b.rows.len() * self.output[2]
    }

    /// Where block `b`'s columns start in a sample's output plane (they are contiguous there).
    fn block_start(&self, b: &ConvBlock) -> usize {
        (b.zs.start * self.output[1] + b.rows.start) * self.output[2]
    }

    /// The column matrix (rows, samples x block_len) of block `b` of the batch x (N, C, D, H, W),
    /// one row per task.
    fn vol2col<T: Elem>(&self, x: &[T], b: &ConvBlock) -> Vec<T> {
        let (len, sample) = (self.block_len(b), self.c * self.volume());
        let width = b.samples.len() * len;
        let mut col = vec![T::zero(); self.rows() * width];
        col.par_chunks_mut(width).enumerate().for_each(|(r, row)| {
            for (k, n) in b.samples.clone().enumerate() {
                let (xs, seg) = (&x[n * sample..(n + 1) * sample], &mut row[k * len..(k + 1) * len]);
                let s = self.stride[2];
                self.for_row(r, b, |j, i, n| {
                    if s == 1 {
                        seg[j..j + n].copy_from_slice(&xs[i..i + n]);
                    } else {
                        seg[j..j + n].iter_mut().zip(xs[i..].iter().step_by(s)).for_each(|(c, &v)| *c = v);
                    }
                });
            }
        });
        col
    }

    /// Adds block `b`'s column-matrix entries back into the batch's gradient dx (N, C, D, H, W),
    /// one (sample, channel) per task and its rows in order.
    fn col2vol<T: Elem>(&self, col: &[T], b: &ConvBlock, dx: &mut [T]) {
        let (k, volume, len) = (self.rows() / self.c, self.volume(), self.block_len(b));
        let width = b.samples.len() * len;
        let batch = &mut dx[b.samples.start * self.c * volume..b.samples.end * self.c * volume];
        batch.par_chunks_mut(volume).enumerate().for_each(|(task, xc)| {
            let (sample, c) = (task / self.c, task % self.c);
            for r in c * k..(c + 1) * k {
                let row = &col[r * width + sample * len..r * width + (sample + 1) * len];
                let s = self.stride[2];
                self.for_row(r, b, |j, i, n| {
                    let i = i - c * volume;
                    xc[i..].iter_mut().step_by(s).zip(&row[j..j + n]).for_each(|(x, &g)| *x += g);
                });
            }
        });
    }
}

/// A block of the column matrix: output rows `rows` of depth slices `zs` of samples `samples`,
/// side by side (`rows` is a part of the plane only in a block of one slice of one sample).
struct ConvBlock {
    samples: std::ops::Range<usize>,
    zs: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
}

struct Conv3dOp {
    shape: Conv3dShape,
}

/// A matrix operand of [`matmul`]: row-major elements, stored transposed or not.
#[derive(Clone, Copy)]
struct Mat<'a, T> {
    data: &'a [T],
    /// The stored matrix is the operand's transpose: (cols, rows) row-major.
    t: bool,
}

fn mat<T>(data: &[T], t: bool) -> Mat<'_, T> {
    Mat { data, t }
}

/// `dst (m, n) (+)= a (m, k) @ b (k, n)` with gemm, the matrix product candle's CPU backend runs,
/// called directly: operands are read in place (a transposed operand is a stride, not a copy) and
/// the product is written into `dst` (added to it with `accumulate`). Split over candle's threads;
/// the bits do not depend on their number (threads split the output, each element's sum over k
/// runs in one fixed order).
fn matmul<T: Elem>(dst: &mut [T], a: Mat<T>, b: Mat<T>, (m, k, n): (usize, usize, usize), accumulate: bool) {
    assert!(dst.len() == m * n && a.data.len() == m * k && b.data.len() == k * n, "matmul: operands do not match ({m}, {k}) @ ({k}, {n})");
    // (row stride, column stride) of a row-major (rows, cols) operand, or of its stored transpose.
    let strides = |t: bool, rows: usize, cols: usize| if t { (1, rows as isize) } else { (cols as isize, 1) };
    let ((a_rs, a_cs), (b_rs, b_cs)) = (strides(a.t, m, k), strides(b.t, k, n));
    let threads = candle_core::utils::get_num_threads();
    let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: every access stays within the slices, whose lengths are checked above against the
    // shapes the strides describe.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
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
    let mut dst = vec![T::zero(); mkn.0 * mkn.2];
    matmul(&mut dst, a, b, mkn, false);
    dst
}

impl Conv3dOp {
    fn forward<T: Elem>(&self, x: &[T], w: &[T]) -> Result<Vec<T>> {
        let s = &self.shape;
        let cols = s.cols();
        let mut y = vec![T::zero(); s.n * s.o * cols];
        for b in s.blocks() {
            let (start, len) = (s.block_start(&b), s.block_len(&b));
            let width = b.samples.len() * len;
            let out = matmul_new(mat(w, false), mat(&s.vol2col(x, &b), false), (s.o, s.rows(), width)); // (O, samples x len)
            for (k, n) in b.samples.clone().enumerate() {
                let y_n = &mut y[n * s.o * cols..(n + 1) * s.o * cols];
                for (y, row) in y_n.chunks_mut(cols).zip(out.chunks(width)) {
                    y[start..start + len].copy_from_slice(&row[k * len..(k + 1) * len]);
                }
            }
        }
        Ok(y)
    }

    /// Per block: dW += gy @ col^T, dx += col2vol(W^T @ gy); in order.
    fn backward<T: Elem>(&self, x: &[T], w: &[T], gy: &[T]) -> Result<(Vec<T>, Vec<T>)> {
        let s = &self.shape;
        let cols = s.cols();
        let mut dw = vec![T::zero(); w.len()];
        let mut dx = vec![T::zero(); x.len()];
        for b in s.blocks() {
            let (start, len) = (s.block_start(&b), s.block_len(&b));
            let width = b.samples.len() * len;
            // The output gradient's columns of this block, (O, samples x len).
            let g: Vec<T> = (0..s.o)
                .flat_map(|o| b.samples.clone().flat_map(move |n| gy[(n * s.o + o) * cols + start..(n * s.o + o) * cols + start + len].iter().copied()))
                .collect();
            matmul(&mut dw, mat(&g, false), mat(&s.vol2col(x, &b), true), (s.o, width, s.rows()), true); // += (O, rows)
            s.col2vol(&matmul_new(mat(w, true), mat(&g, false), (s.rows(), s.o, width)), &b, &mut dx);
            // (rows, samples x len)
        }
        Ok((dx, dw))
    }
}

impl CustomOp2 for Conv3dOp {
    fn name(&self) -> &'static str {
        "fused-conv3d"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let y = per_float!(s1, "conv3d", self.forward(&slice(s1, l1)?, &slice(s2, l2)?)?);
        let s = &self.shape;
        Ok((y, Shape::from(vec![s.n, s.o, s.output[0], s.output[1], s.output[2]])))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let (dx, dw) = per_dtype!(x.dtype(), T => {
            let (dx, dw) = with_slice::<T, _>(x, |xs| with_slice(w, |ws| with_slice(&g, |gs| self.backward(xs, ws, gs))))?;
            (shaped(dx, x)?, shaped(dw, w)?)
        });
        Ok((Some(dx), Some(dw)))
    }
}

// ---------------------------------------------------------------------------------------------
// Embedding

/// Rows `ids` (u32, any shape) of the table w (V, C), as (ids.., C). Its backward builds the
/// table's gradient in one allocation (candle's `index_select` makes a zero table, then a second
/// one with the rows added), rows added in token order.
pub fn embedding(w: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let mut shape = ids.dims().to_vec();
    shape.push(w.dim(1)?);
    if !fused(w) || ids.dtype() != DType::U32 {
        return w.index_select(&ids.flatten_all()?, 0)?.reshape(shape);
    }
    w.contiguous()?.apply_op2(&ids.flatten_all()?.contiguous()?, EmbeddingOp { vocab: w.dim(0)?, width: w.dim(1)? })?.reshape(shape)
}

struct EmbeddingOp {
    vocab: usize,
    width: usize,
}

impl EmbeddingOp {
    fn check(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&i| i as usize >= self.vocab) {
            Some(bad) => candle_core::bail!("embedding: id {bad} is outside the vocabulary of {}", self.vocab),
            None => Ok(()),
        }
    }

    fn forward<T: Elem>(&self, w: &[T], ids: &[u32]) -> Vec<T> {
        let c = self.width;
        let mut y = vec![T::zero(); ids.len() * c];
        y.par_chunks_mut(c).zip(ids.par_iter()).for_each(|(y, &i)| y.copy_from_slice(&w[i as usize * c..(i as usize + 1) * c]));
        y
    }

    fn backward<T: Elem>(&self, ids: &[u32], g: &[T]) -> Vec<T> {
        let c = self.width;
        let mut dw = vec![T::zero(); self.vocab * c];
        for (&i, g) in ids.iter().zip(g.chunks(c)) {
            dw[i as usize * c..(i as usize + 1) * c].iter_mut().zip(g).for_each(|(d, &g)| *d += g);
        }
        dw
    }
}

impl CustomOp2 for EmbeddingOp {
    fn name(&self) -> &'static str {
        "fused-embedding"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let ids = slice::<u32>(s2, l2)?;
        self.check(&ids)?;
        let y = per_float!(s1, "embedding", self.forward(&slice(s1, l1)?, &ids));
        Ok((y, Shape::from((ids.len(), self.width))))
    }

    fn bwd(&self, w: &Tensor, ids: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let dw = per_dtype!(w.dtype(), T => shaped(with_slice::<u32, _>(ids, |ids| with_slice::<T, _>(&g, |gs| Ok(self.backward(ids, gs))))?, w)?);
        Ok((Some(dw), None))
    }
}

// ---------------------------------------------------------------------------------------------
// Transposed 3D convolution, kernel = stride = 2

/// `conv_transpose3d(x, w, stride 2) + b` for x (N, C, D, H, W), w (C, O, 2, 2, 2), b (O): every
/// input voxel writes its own 2x2x2 output block, so it is one matrix product per sample and a
/// scatter. One op: it keeps only x (the composed version keeps the product, its permuted copy
/// and the sum before the bias). CPU f32/f64 only: check [`fused`] first.
pub(crate) fn conv_transpose3d_k2s2(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (n, c, d, h, wd) = x.dims5()?;
    let (c_w, o, ..) = w.dims5()?;
    if c != c_w || w.dims()[2..] != [2, 2, 2] || b.dims() != [o] {
        candle_core::bail!("conv_transpose3d_k2s2: kernel {:?} and bias {:?} do not fit input with {c} channels", w.dims(), b.dims())
    }
    let op = ConvTranspose3dOp { n, c, o, input: [d, h, wd] };
    x.contiguous()?.apply_op3(&operand(w, x)?, &operand(b, x)?, op)
}

struct ConvTranspose3dOp {
    n: usize,
    c: usize,
    o: usize,
    input: [usize; 3],
}

impl ConvTranspose3dOp {
    fn volume(&self) -> usize {
        self.input.iter().product()
    }

    /// Calls `f(row of the (O 8, DHW) product, column, output index within the sample)` for every
    /// output voxel of output channel `oc`.
    fn for_channel(&self, oc: usize, mut f: impl FnMut(usize, usize, usize)) {
        let [d, h, w] = self.input;
        for k in 0..8 {
            let (a, p, q) = (k / 4, (k / 2) % 2, k % 2);
            for z in 0..d {
                for i in 0..h {
                    for j in 0..w {
                        let out = ((oc * 2 * d + 2 * z + a) * 2 * h + 2 * i + p) * 2 * w + 2 * j + q;
                        f(oc * 8 + k, (z * h + i) * w + j, out);
                    }
                }
            }
        }
    }

    fn forward<T: Elem>(&self, x: &[T], w: &[T], b: &[T]) -> Result<Vec<T>> {
        let (v, ok) = (self.volume(), self.o * 8);
        let mut y = vec![T::zero(); self.n * ok * v];
        for (x, y) in x.chunks(self.c * v).zip(y.chunks_mut(ok * v)) {
            let prod = matmul_new(mat(w, true), mat(x, false), (ok, self.c, v)); // (O 8, DHW)
            y.par_chunks_mut(8 * v).enumerate().for_each(|(oc, y)| self.for_channel(oc, |r, col, out| y[out - oc * 8 * v] = prod[r * v + col] + b[oc]));
        }
        Ok(y)
    }

    /// Per sample, with G (O 8, DHW) the output gradient gathered back into the product's layout:
    /// dx = W G, dW += x G^T, db = sums of G's rows, in order.
    fn backward<T: Elem>(&self, x: &[T], w: &[T], gy: &[T]) -> Result<(Vec<T>, Vec<T>, Vec<T>)> {
        let (v, ok) = (self.volume(), self.o * 8);
        let (mut dx, mut dw, mut db) = (Vec::with_capacity(x.len()), vec![T::zero(); w.len()], vec![T::zero(); self.o]);
        for (x, gy) in x.chunks(self.c * v).zip(gy.chunks(ok * v)) {
            let mut g = vec![T::zero(); ok * v];
            g.par_chunks_mut(8 * v).enumerate().for_each(|(oc, g)| self.for_channel(oc, |r, col, out| g[(r - oc * 8) * v + col] = gy[out]));
            for (oc, rows) in g.chunks(8 * v).enumerate() {
                db[oc] += rows.iter().copied().sum::<T>();
            }
            matmul(&mut dw, mat(x, false), mat(&g, true), (self.c, v, ok), true); // += (C, O 8)
            dx.extend(matmul_new(mat(w, false), mat(&g, false), (self.c, ok, v)));
            // (C, DHW)
        }
        Ok((dx, dw, db))
    }
}

impl CustomOp3 for ConvTranspose3dOp {
    fn name(&self) -> &'static str {
        "fused-conv-transpose3d-k2s2"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> Result<(CpuStorage, Shape)> {
        let y = per_float!(s1, "conv_transpose3d", self.forward(&slice(s1, l1)?, &slice(s2, l2)?, &slice(s3, l3)?)?);
        let [d, h, w] = self.input;
        Ok((y, Shape::from(vec![self.n, self.o, 2 * d, 2 * h, 2 * w])))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, b: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let (dx, dw, db) = per_dtype!(x.dtype(), T => {
            let (dx, dw, db) = with_slice::<T, _>(x, |xs| with_slice(w, |ws| with_slice(&g, |gs| self.backward(xs, ws, gs))))?;
            (shaped(dx, x)?, shaped(dw, w)?, shaped(db, b)?)
        });
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

// ---------------------------------------------------------------------------------------------
// Max pooling

/// Max-pooling over the last two dims of x (.., H, W): a k x k window, stride s, padding p (which
/// never wins). Keeps nothing but its input: backward finds each window's maximum again (the first
/// in row-major order, NaN winning, as PyTorch's kernel) instead of holding indices. CPU f32/f64
/// only: check [`fused`] first.
pub(crate) fn max_pool2d(x: &Tensor, k: usize, s: usize, p: usize) -> Result<Tensor> {
    let r = x.rank();
    if r < 2 || k == 0 || s == 0 || p >= k {
        candle_core::bail!("max_pool2d: needs rank >= 2, k >= 1, s >= 1 and p < k; got {:?}, k {k}, s {s}, p {p}", x.dims())
    }
    let (h, w) = (x.dim(r - 2)?, x.dim(r - 1)?);
    if h + 2 * p < k || w + 2 * p < k {
        candle_core::bail!("max_pool2d: input {h}x{w} padded by {p} is smaller than the window {k}")
    }
    x.contiguous()?.apply_op1(MaxPool2dOp { k, s, p, h, w })
}

struct MaxPool2dOp {
    k: usize,
    s: usize,
    p: usize,
    h: usize,
    w: usize,
}

impl MaxPool2dOp {
    fn out(&self) -> (usize, usize) {
        ((self.h + 2 * self.p - self.k) / self.s + 1, (self.w + 2 * self.p - self.k) / self.s + 1)
    }

    /// Calls `f(output index, input index of its window's maximum)` for every output of a plane.
    fn argmax<T: Elem>(&self, plane: &[T], mut f: impl FnMut(usize, usize)) {
        let (ho, wo) = self.out();
        let inside = |at: usize, k: usize, n: usize| (at + k).checked_sub(self.p).filter(|&v| v < n);
        for i in 0..ho {
            for j in 0..wo {
                let mut best: Option<(usize, T)> = None;
                for r in (0..self.k).filter_map(|di| inside(i * self.s, di, self.h)) {
                    for c in (0..self.k).filter_map(|dj| inside(j * self.s, dj, self.w)) {
                        let v = plane[r * self.w + c];
                        if best.is_none_or(|(_, b)| v > b || v.is_nan()) {
                            best = Some((r * self.w + c, v));
                        }
                    }
                }
                f(i * wo + j, best.expect("p < k: every window holds an input").0);
            }
        }
    }

    fn forward<T: Elem>(&self, x: &[T]) -> Vec<T> {
        let (ho, wo) = self.out();
        let mut y = vec![T::zero(); x.len() / (self.h * self.w) * ho * wo];
        y.par_chunks_mut(ho * wo).zip(x.par_chunks(self.h * self.w)).for_each(|(y, x)| self.argmax(x, |o, i| y[o] = x[i]));
        y
    }

    fn backward<T: Elem>(&self, x: &[T], g: &[T]) -> Vec<T> {
        let (ho, wo) = self.out();
        let mut dx = vec![T::zero(); x.len()];
        dx.par_chunks_mut(self.h * self.w)
            .zip(x.par_chunks(self.h * self.w).zip(g.par_chunks(ho * wo)))
            .for_each(|(dx, (x, g))| self.argmax(x, |o, i| dx[i] += g[o]));
        dx
    }
}

impl CustomOp1 for MaxPool2dOp {
    fn name(&self) -> &'static str {
        "fused-max-pool2d"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let y = per_float!(s, "max_pool2d", self.forward(&slice(s, l)?));
        let mut dims = l.dims().to_vec();
        let r = dims.len();
        (dims[r - 2], dims[r - 1]) = self.out();
        Ok((y, Shape::from(dims)))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let g = g.contiguous()?;
        let dx = per_dtype!(x.dtype(), T => shaped(with_slice::<T, _>(x, |xs| with_slice(&g, |gs| Ok(self.backward(xs, gs))))?, x)?);
        Ok(Some(dx))
    }
}

// ---------------------------------------------------------------------------------------------
// Linear

/// `x @ w + b` over the last dimension of x (.., in): `w` is (in, out), or (out, in) with
/// `w_is_out_in` (Hugging Face's `Linear`; GPT-2's `Conv1D` stores (in, out)). One op: the
/// product before the bias is no graph node, so it is not kept for backward as `matmul` followed
/// by `broadcast_add` keeps it.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>, w_is_out_in: bool) -> Result<Tensor> {
    let k = x.dim(D::Minus1)?;
    let w_in = if w_is_out_in { w.t()? } else { w.clone() }; // (in, out)
    if !fused(x) {
        let rows = x.elem_count() / k;
        let y = x.reshape((rows, k))?.matmul(&w_in)?;
        let y = match b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        let mut dims = x.dims().to_vec();
        *dims.last_mut().expect("rank >= 1") = y.dim(1)?;
        return y.reshape(dims);
    }
    let (x, w) = (x.contiguous()?, operand(w, x)?);
    match b {
        Some(b) => x.apply_op3(&w, &operand(b, &x)?, LinearOp { w_is_out_in }),
        None => x.apply_op2(&w, LinearOp { w_is_out_in }),
    }
}

struct LinearOp {
    w_is_out_in: bool,
}

impl LinearOp {
    fn cpu_fwd(&self, x: (&CpuStorage, &Layout), w: (&CpuStorage, &Layout), b: Option<(&CpuStorage, &Layout)>) -> Result<(CpuStorage, Shape)> {
        let y = per_float!(x.0, "linear", self.forward(&slice(x.0, x.1)?, x.1, &slice(w.0, w.1)?, b.map(|(s, l)| slice(s, l)).transpose()?.as_deref()));
        let mut dims = x.1.dims().to_vec();
        *dims.last_mut().expect("rank >= 1") = w.1.dims()[if self.w_is_out_in { 0 } else { 1 }];
        Ok((y, Shape::from(dims)))
    }

    fn forward<T: Elem>(&self, x: &[T], xl: &Layout, w: &[T], b: Option<&[T]>) -> Vec<T> {
        let k = *xl.dims().last().expect("rank >= 1");
        let (rows, n) = (x.len() / k, w.len() / k);
        let mut y = match b {
            Some(b) => b.repeat(rows),
            None => vec![T::zero(); rows * n],
        };
        // y = b + x @ w_in, the bias added first: as one product accumulated onto it.
        matmul(&mut y, mat(x, false), mat(w, self.w_is_out_in), (rows, k, n), b.is_some());
        y
    }

    /// dx = g w_in^T, dw = x^T g (as g^T x for an (out, in) weight), db = column sums of g.
    fn bwd(&self, x: &Tensor, w: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let k = x.dim(D::Minus1)?;
        let (rows, n) = (x.elem_count() / k, w.elem_count() / k);
        let g = g.contiguous()?;
        let (dx, dw) = per_dtype!(x.dtype(), T => {
            let (dx, dw) = with_slice::<T, _>(x, |xs| with_slice(w, |ws| with_slice(&g, |gs| {
                // w_in^T is the stored w read the other way round.
                let dx = matmul_new(mat(gs, false), mat(ws, !self.w_is_out_in), (rows, n, k));
                let dw = if self.w_is_out_in {
                    matmul_new(mat(gs, true), mat(xs, false), (n, rows, k))
                } else {
                    matmul_new(mat(xs, true), mat(gs, false), (k, rows, n))
                };
                Ok((dx, dw))
            })))?;
            (shaped(dx, x)?, shaped(dw, w)?)
        });
        // The bias gradient summed in f32 at least (candle would sum a bf16 g in bf16).
        let g = if is_half(g.dtype()) { g.to_dtype(DType::F32)? } else { g };
        Ok((dx, dw, g.reshape((rows, n))?.sum(0)?))
    }
}

impl CustomOp2 for LinearOp {
    fn name(&self) -> &'static str {
        "fused-linear"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        LinearOp::cpu_fwd(self, (s1, l1), (s2, l2), None)
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = LinearOp::bwd(self, x, w, g)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "fused-linear-bias"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> Result<(CpuStorage, Shape)> {
        LinearOp::cpu_fwd(self, (s1, l1), (s2, l2), Some((s3, l3)))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, b: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = LinearOp::bwd(self, x, w, g)?;
        Ok((Some(dx), Some(dw), Some(db.to_dtype(b.dtype())?)))
    }
}

// ---------------------------------------------------------------------------------------------
// Attention

/// Scaled dot-product attention of q, k, v (B, heads, T, d): `dropout(softmax(scale q k^T)) v`,
/// with the causal mask if `causal` and dropout by `dropout = (key, p)`. One op: the scores and
/// probabilities are rebuilt in backward (and the dropout mask drawn again from its key), so it
/// keeps nothing but q, k and v, where the composed attention keeps three maps of (B, heads, T, T).
/// `padding` (B, S), nonzero where a key may be attended to (Hugging Face's `attention_mask`),
/// masks the padded keys for every query; a query with no key left gets zeros.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool, padding: Option<&Tensor>, dropout: Option<(RngKey, f32)>) -> Result<Tensor> {
    let (b, heads, t, _) = q.dims4()?;
    let s = k.dim(2)?;
    if let Some(m) = padding {
        if m.dims() != [b, s] {
            candle_core::bail!("attention: the padding mask must be (batch {b}, keys {s}), got {:?}", m.dims())
        }
    }
    if !fused(q) {
        let scores = q.matmul(&k.t()?)?;
        let scores = match padding {
            Some(m) => {
                let keep = m.ne(0.0)?.reshape((b, 1, 1, s))?.broadcast_as(scores.shape())?;
                let neg_inf = Tensor::new(f32::NEG_INFINITY, q.device())?.to_dtype(scores.dtype())?.broadcast_as(scores.shape())?;
                keep.where_cond(&scores, &neg_inf)?
            }
            None => scores,
        };
        let p = softmax_last_dim(&scores, scale, causal)?;
        let p = match dropout {
            Some((key, rate)) => self::dropout(&p, key, rate)?,
            None => p,
        };
        return p.matmul(v);
    }
    let padding = match padding {
        Some(m) => Some((std::sync::Arc::new(m.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(|v| v != 0.0).collect()), heads * t)),
        None => None,
    };
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.to_dtype(q.dtype())?.contiguous()?);
    q.apply_op3(&k, &v, AttentionOp { scale, causal, padding, dropout })
}

struct AttentionOp {
    scale: f64,
    causal: bool,
    /// Which keys each batch element may attend to, and the rows per batch element.
    padding: Option<(std::sync::Arc<Vec<bool>>, usize)>,
    dropout: Option<(RngKey, f32)>,
}

impl AttentionOp {
    fn softmax(&self, t: usize) -> SoftmaxOp {
        SoftmaxOp { scale: self.scale, causal: self.causal, rows_per_block: t, padding: self.padding.clone() }
    }

    /// The probabilities (B, heads, T, T), flat, of detached q and k.
    fn probabilities<T: Elem>(&self, q: &Tensor, k: &Tensor) -> Result<Vec<T>> {
        let scores = q.matmul(&k.t()?)?.flatten_all()?.to_vec1::<T>()?;
        Ok(self.softmax(q.dim(2)?).forward(&scores, k.dim(2)?))
    }

    fn drop_out<T: Elem>(&self, p: &mut [T]) {
        if let Some((key, rate)) = self.dropout {
            DropoutOp { key, p: rate }.mask_in_place(p);
        }
    }

    /// A flat (B, heads, T, S) map as a tensor, without copying it.
    fn map<T: Elem>(m: Vec<T>, q: &Tensor, k: &Tensor) -> Result<Tensor> {
        Tensor::from_vec(m, (q.dim(0)?, q.dim(1)?, q.dim(2)?, k.dim(2)?), q.device())
    }

    fn forward<T: Elem>(&self, q: Tensor, k: Tensor, v: Tensor) -> Result<Vec<T>> {
        let mut p = self.probabilities::<T>(&q, &k)?;
        self.drop_out(&mut p);
        Self::map(p, &q, &k)?.matmul(&v)?.flatten_all()?.to_vec1::<T>()
    }

    /// With P the probabilities and P' = dropout(P): dV = P'^T g; dP = dropout(g V^T) (the same
    /// mask); dS = softmax backward of dP (scale included); dQ = dS K; dK = dS^T Q. At most three
    /// maps of (B, heads, T, T) are alive at once.
    fn backward<T: Elem>(&self, q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let p = self.probabilities::<T>(q, k)?;
        let mut dropped = p.clone();
        self.drop_out(&mut dropped);
        let dv = Self::map(dropped, q, k)?.t()?.matmul(g)?;
        let mut dp = g.matmul(&v.t()?)?.flatten_all()?.to_vec1::<T>()?;
        self.drop_out(&mut dp);
        let ds = self.softmax(q.dim(2)?).backward(&p, &dp, k.dim(2)?);
        drop((p, dp));
        let ds = Self::map(ds, q, k)?;
        Ok((ds.matmul(k)?, ds.t()?.matmul(q)?, dv))
    }
}

impl CustomOp3 for AttentionOp {
    fn name(&self) -> &'static str {
        "fused-attention"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> Result<(CpuStorage, Shape)> {
        fn run<T: Elem>(op: &AttentionOp, s: [(&CpuStorage, &Layout); 3]) -> Result<Vec<T>> {
            let t = |(st, l): (&CpuStorage, &Layout)| Tensor::from_slice(&slice::<T>(st, l)?, l.dims(), &candle_core::Device::Cpu);
            op.forward::<T>(t(s[0])?, t(s[1])?, t(s[2])?)
        }
        let args = [(s1, l1), (s2, l2), (s3, l3)];
        let y = per_float!(s1, "attention", run(self, args)?);
        let mut dims = l1.dims().to_vec();
        *dims.last_mut().expect("rank 4") = *l3.dims().last().expect("rank 4");
        Ok((y, Shape::from(dims)))
    }

    fn bwd(&self, q: &Tensor, k: &Tensor, v: &Tensor, _y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // Half precision runs in f32 (candle's CPU matrix product has no bf16).
        let dtype = q.dtype();
        let wide = |t: &Tensor| if is_half(dtype) { t.detach().to_dtype(DType::F32) } else { Ok(t.detach()) };
        let (q, k, v, g) = (wide(q)?, wide(k)?, wide(v)?, wide(g)?.contiguous()?);
        let (dq, dk, dv) = per_dtype!(q.dtype(), T => self.backward::<T>(&q, &k, &v, &g)?);
        Ok((Some(dq.to_dtype(dtype)?), Some(dk.to_dtype(dtype)?), Some(dv.to_dtype(dtype)?)))
    }
}

// ---------------------------------------------------------------------------------------------
// GELU

/// GELU, with the tanh approximation (GPT-2's `gelu_new`) or exact with erf (BERT's `gelu`),
/// computed in f64 per element, in parallel. Keeps its input, as candle's does, but its backward
/// is one pass where candle's composes about ten tensors of the input's size.
pub fn gelu(x: &Tensor, exact: bool) -> Result<Tensor> {
    if !fused(x) {
        return if exact { x.gelu_erf() } else { x.gelu() };
    }
    x.contiguous()?.apply_op1(GeluOp { exact })
}

struct GeluOp {
    exact: bool,
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

impl GeluOp {
    /// (gelu(x), gelu'(x)).
    fn eval(&self, x: f64) -> (f64, f64) {
        if self.exact {
            let cdf = 0.5 * (1.0 + candle_core::cpu::erf::erf_f64(x / std::f64::consts::SQRT_2));
            let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
            (x * cdf, cdf + x * pdf)
        } else {
            let inner = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
            let t = inner.tanh();
            let d_inner = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x);
            (0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner)
        }
    }

    /// gelu(x), or with `g` the gradient g gelu'(x); element by element, in parallel.
    fn map<T: Elem>(&self, x: &[T], g: Option<&[T]>) -> Vec<T> {
        let mut y = vec![T::zero(); x.len()];
        y.par_chunks_mut(DROPOUT_CHUNK).enumerate().for_each(|(c, y)| {
            for (j, y) in y.iter_mut().enumerate() {
                let i = c * DROPOUT_CHUNK + j;
                let (value, slope) = self.eval(wide(x[i]));
                *y = match g {
                    Some(g) => elem(wide(g[i]) * slope),
                    None => elem(value),
                };
            }
        });
        y
    }
}

impl CustomOp1 for GeluOp {
    fn name(&self) -> &'static str {
        "fused-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let y = per_float!(s, "gelu", self.map(&slice(s, l)?, None));
        Ok((y, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        let g = g.contiguous()?;
        let dx = per_dtype!(x.dtype(), T => shaped(with_slice::<T, _>(x, |xs| with_slice(&g, |gs| Ok(self.map(xs, Some(gs)))))?, x)?);
        Ok(Some(dx))
    }
}
