//! Cross-entropy: the mean (optionally weighted) negative log-likelihood of logits; keeps nothing
//! but its inputs.

use crate::fused::dtype::widened;
use crate::fused::elem::{elem, Elem};
use crate::fused::generic::GenericOp;
use crate::fused::op::{exactly, FusedOp, Operand};
use crate::fused::parallel::{max_lanes, sum_lanes};
use crate::fused::route::{fused, generic};
use crate::fused::storage::{shaped, slice, with_slice};
use crate::fused::uninit::uninit;
use candle_core::{CpuStorage, DType, Result, Shape, Tensor, D};
use rayon::prelude::*;

/// The target id of a position the loss skips: a causal LM's padding (PyTorch's `ignore_index`,
/// -100 in transformers' labels; ids here are u32).
pub const IGNORE: u32 = u32::MAX;

/// Cross-entropy of logits (N, V) against class ids (N) u32: the mean over rows of
/// `logsumexp(row) - row[target]`, or with `weights` (N) the weighted mean
/// `sum(w_i ce_i) / sum(w_i)` (BERT scores only its masked positions). A row whose target is
/// [`IGNORE`] weighs 0 (the mean is over the others, as PyTorch's `ignore_index`). Weights that
/// are all zero are an error (`NO_WEIGHT`).
pub fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    weights: Option<&Tensor>,
) -> Result<Tensor> {
    let (n, _) = logits.dims2()?;
    let weights = match weights {
        Some(w) => w.to_dtype(logits.dtype())?,
        None => Tensor::ones(n, logits.dtype(), logits.device())?,
    };
    let (targets, weights) = &skipping_ignored(targets, weights)?;
    if generic(logits) {
        let targets = targets.to_dtype(DType::U32)?.contiguous()?;
        let loss = composed(&widened(&logits.detach())?, &targets, &widened(weights)?)?;
        // d loss / d logits = (softmax(logits) - onehot(target)) w / sum(w), times the loss's
        // gradient.
        let backward = move |inputs: &[Tensor],
                             _: &Tensor,
                             g: &Tensor,
                             _want: &[bool]|
              -> Result<Vec<Option<Tensor>>> {
            let (logits, targets, weights) =
                (widened(&inputs[0])?, &inputs[1], widened(&inputs[2])?);
            let v = logits.dim(1)?;
            let classes = Tensor::arange(0u32, v as u32, logits.device())?.unsqueeze(0)?;
            let onehot = targets.unsqueeze(1)?.broadcast_eq(&classes)?.to_dtype(logits.dtype())?;
            let total = weights.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            let scale =
                weights.unsqueeze(1)?.broadcast_mul(&widened(g)?.to_dtype(logits.dtype())?)?;
            let d =
                (candle_nn::ops::softmax(&logits, D::Minus1)? - onehot)?.broadcast_mul(&scale)?;
            Ok(vec![Some((d / total)?.to_dtype(inputs[0].dtype())?), None, None])
        };
        let loss =
            loss.to_dtype(if logits.dtype() == DType::F64 { DType::F64 } else { DType::F32 })?;
        return logits.contiguous()?.apply_op3(
            &targets,
            &weights.contiguous()?,
            GenericOp::new("generic-cross-entropy", loss, Box::new(backward)),
        );
    }
    if !fused(logits) {
        return composed(logits, targets, weights);
    }
    logits.contiguous()?.apply_op3(
        &targets.to_dtype(DType::U32)?.contiguous()?,
        &weights.contiguous()?,
        CrossEntropyOp,
    )
}

/// `targets` and `weights` with each [`IGNORE`]d row's target set to 0 and its weight to 0 (the
/// same tensors where no target is ignored).
fn skipping_ignored(targets: &Tensor, weights: Tensor) -> Result<(Tensor, Tensor)> {
    let ids = targets.to_dtype(DType::U32)?.flatten_all()?.to_vec1::<u32>()?;
    if !ids.contains(&IGNORE) {
        return Ok((targets.clone(), weights));
    }
    let kept: Vec<f32> = ids.iter().map(|&t| f32::from(u8::from(t != IGNORE))).collect();
    let ids: Vec<u32> = ids.into_iter().map(|t| if t == IGNORE { 0 } else { t }).collect();
    let device = targets.device();
    let kept = Tensor::from_vec(kept, weights.shape(), device)?.to_dtype(weights.dtype())?;
    Ok((Tensor::from_vec(ids, targets.shape(), device)?, (weights * kept)?))
}

/// The weighted mean negative log-likelihood from candle's ops.
fn composed(logits: &Tensor, targets: &Tensor, weights: &Tensor) -> Result<Tensor> {
    let logp = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let picked = logp.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)?;
    let total = weights.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    if total == 0.0 {
        candle_core::bail!("{NO_WEIGHT}")
    }
    ((picked * weights)?.sum_all()? / total)?.neg()
}

struct CrossEntropyOp;

/// The error of a weighted cross-entropy whose weights are all zero. PyTorch returns NaN (a mean
/// over no target), which then reads as a diverged run; here it is refused, naming the cause.
const NO_WEIGHT: &str = "cross_entropy: every weight is zero (or every target ignored), so the \
    batch has no position to score (the mean over none is undefined)";

/// logsumexp of a row, `buf` its scratch space (the row's exps).
fn log_sum_exp<T: Elem>(row: &[T], buf: &mut Vec<T>) -> T {
    let max = max_lanes(row);
    buf.clear();
    buf.extend(row.iter().map(|&v| v - max));
    T::exp_in_place(buf);
    max + sum_lanes(buf).ln()
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
        let losses: Vec<T> = logits
            .par_chunks(v)
            .zip(targets.par_iter())
            .map_init(Vec::new, |buf, (row, &t)| log_sum_exp(row, buf) - row[t as usize])
            .collect();
        let total = losses.iter().zip(weights).fold(T::zero(), |acc, (&l, &w)| acc + l * w);
        Ok(total / weight)
    }

    /// d/dlogits = g w_i / sum(w) (softmax(row) - onehot(target)).
    fn backward<T: Elem>(logits: &[T], targets: &[u32], weights: &[T], g: T) -> Vec<T> {
        let v = logits.len() / targets.len();
        let scale = g / weights.iter().copied().sum::<T>();
        // SAFETY: each row below writes every element of its row of d.
        let mut d = unsafe { uninit::<T>(logits.len()) };
        d.par_chunks_mut(v)
            .zip(logits.par_chunks(v))
            .zip(targets.par_iter().zip(weights.par_iter()))
            .for_each_init(Vec::new, |buf, ((d, row), (&t, &w))| {
                let lse = log_sum_exp(row, buf);
                let s = scale * w;
                d.iter_mut().zip(row).for_each(|(d, &x)| *d = x - lse);
                T::exp_in_place(d);
                d.iter_mut().for_each(|d| *d *= s);
                d[t as usize] -= s;
            });
        d
    }
}

impl FusedOp for CrossEntropyOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let [(logits, ll), (targets, tl), (weights, wl)] = exactly(inputs)?;
        let targets = slice::<u32>(targets, tl)?;
        let loss = match logits {
            // The loss of half-precision logits is computed and returned in f32.
            CpuStorage::BF16(_) | CpuStorage::F16(_) => {
                CpuStorage::F32(vec![Self::forward::<f32>(
                    &slice(logits, ll)?,
                    &targets,
                    &slice(weights, wl)?,
                )?])
            }
            _ => per_float!(
                logits,
                "cross_entropy",
                vec![Self::forward(&slice(logits, ll)?, &targets, &slice(weights, wl)?)?]
            ),
        };
        Ok((loss, Shape::from(())))
    }

    fn bwd(&self, inputs: &[&Tensor], _loss: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [logits, targets, weights] = exactly(inputs)?;
        let g = g.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let d = with_slice::<u32, _>(targets, |t| {
            per_dtype!(logits.dtype(), T => {
                let d = with_slice::<T, _>(logits, |l| {
                    with_slice(weights, |w| Ok(Self::backward(l, t, w, elem::<T>(g))))
                })?;
                shaped(d, logits)
            })
        })?;
        Ok(vec![Some(d), None, None])
    }
}

custom_op!(CrossEntropyOp: 3 "fused-cross-entropy");
