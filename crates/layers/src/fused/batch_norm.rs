//! BatchNorm in training mode, optionally with the residual and ReLU that follow it: keeps its
//! input and output (a composed BatchNorm + ReLU keeps 7 tensors of that size).

use super::generic::{generic, GenericOp};
use super::{elem, operand, shaped, slice, uninit, wide, widened, widened_as, with_slice, Elem, FusedOp, Operand};
use candle_core::{CpuStorage, Result, Shape, Tensor};
use num_traits::Float;
use rayon::prelude::*;

/// BatchNorm of x (N, C, *spatial) with the batch's statistics, as PyTorch's training mode:
/// `(x - mean_c) / sqrt(var_c + eps) * weight_c + bias_c` with the biased variance, then
/// `+ residual` if given (same shape as x), then a ReLU if `relu` (a ResNet block's end:
/// `relu(bn(conv(h)) + identity)` as one op, which keeps only x and the output where the composed
/// version keeps the normalised tensor and the sum as well). Returns the output and the batch's
/// per-channel mean and biased variance, each (C) (for the running statistics). For float tensors
/// that take the kernel or the generic route: check [`lean`](super::lean) first.
pub fn batch_norm_train(x: &Tensor, weight: &Tensor, bias: &Tensor, residual: Option<&Tensor>, eps: f64, relu: bool) -> Result<(Tensor, Tensor, Tensor)> {
    if let Some(r) = residual.filter(|r| r.shape() != x.shape()) {
        candle_core::bail!("batch_norm: residual {:?} does not match the input {:?}", r.dims(), x.dims())
    }
    if generic(x) {
        return batch_norm_generic(x, weight, bias, residual, eps, relu);
    }
    let x = x.contiguous()?;
    let (n, c) = (x.dim(0)?, x.dim(1)?);
    let spatial = x.elem_count() / (n * c).max(1);
    let (mean, var) = per_dtype!(x.dtype(), T => with_slice::<T, _>(&x, |xs| Ok(channel_stats(xs, c, spatial)))?);
    let rstd = var.iter().map(|v| 1.0 / (v + eps).sqrt()).collect();
    let op = BatchNormOp { mean: mean.clone(), rstd, relu, channels: c, spatial };
    // Weight and bias travel as one (2, C) operand so that the residual fits a three-input op.
    let wb = operand(&Tensor::stack(&[weight, bias], 0)?, &x)?;
    let y = match residual {
        Some(r) => x.apply_op3(&wb, &r.to_dtype(x.dtype())?.contiguous()?, op)?,
        None => x.apply_op2(&wb, op)?,
    };
    let per_channel = |v: Vec<f64>| Tensor::from_vec(v, c, x.device());
    Ok((y, per_channel(mean)?, per_channel(var)?))
}

/// The generic route ([`super::generic`]): the statistics and the output composed on detached
/// operands in f32 (f64 for f64), and the kernel's backward formula composed, the statistics
/// recomputed from the input. Keeps what the kernel keeps: x, (weight; bias), the residual.
fn batch_norm_generic(x: &Tensor, weight: &Tensor, bias: &Tensor, residual: Option<&Tensor>, eps: f64, relu: bool) -> Result<(Tensor, Tensor, Tensor)> {
    let dtype = x.dtype();
    let xw = widened(&x.detach())?;
    let (mean, var) = statistics(&xw)?;
    let rstd = (&var + eps)?.sqrt()?.recip()?;
    let wb = Tensor::stack(&[weight, bias], 0)?; // (2, C): the op's operand, as on the kernel
    let wb_w = widened_as(&wb.detach(), x)?;
    let (w, b) = (channel_shaped(&wb_w.get(0)?, x.rank())?, channel_shaped(&wb_w.get(1)?, x.rank())?);
    let mut y = xw.broadcast_sub(&mean)?.broadcast_mul(&(rstd.broadcast_mul(&w))?)?.broadcast_add(&b)?;
    if let Some(r) = residual {
        y = (y + widened_as(&r.detach(), x)?)?;
    }
    if relu {
        y = nan_relu(&y)?;
    }
    let (mean_c, var_c) = (mean.flatten_all()?, var.flatten_all()?);
    let y = y.to_dtype(dtype)?;
    let backward = move |inputs: &[Tensor], y: &Tensor, g: &Tensor| -> Result<Vec<Option<Tensor>>> {
        let (x, wb) = (&inputs[0], &inputs[1]);
        let xw = widened(x)?;
        let mut g = widened_as(g, x)?;
        if relu {
            g = y.le(0.0)?.where_cond(&g.zeros_like()?, &g)?; // a NaN output passes its gradient, as in the kernel
        }
        let (mean, var) = statistics(&xw)?;
        let rstd = (var + eps)?.sqrt()?.recip()?;
        let x_hat = xw.broadcast_sub(&mean)?.broadcast_mul(&rstd)?;
        let db = channel_sum(&g)?;
        let dw = channel_sum(&(&g * &x_hat)?)?;
        let m = (x.elem_count() / x.dim(1)?) as f64;
        let w = channel_shaped(&widened_as(&wb.get(0)?, x)?, x.rank())?;
        let (db_m, dw_m) = (channel_shaped(&(&db / m)?, x.rank())?, channel_shaped(&(&dw / m)?, x.rank())?);
        let dx = g.broadcast_sub(&db_m)?.sub(&x_hat.broadcast_mul(&dw_m)?)?.broadcast_mul(&(rstd.broadcast_mul(&w))?)?;
        let dwb = Tensor::stack(&[dw, db], 0)?.to_dtype(wb.dtype())?;
        let dr = if inputs.len() == 3 { Some(g.to_dtype(inputs[2].dtype())?) } else { None };
        Ok([Some(dx.to_dtype(x.dtype())?), Some(dwb), dr].into_iter().take(inputs.len()).collect())
    };
    let op = GenericOp::new(if residual.is_some() { "generic-batch-norm-add" } else { "generic-batch-norm" }, y, Box::new(backward));
    let y = match residual {
        Some(r) => x.contiguous()?.apply_op3(&wb, &r.contiguous()?, op)?,
        None => x.contiguous()?.apply_op2(&wb, op)?,
    };
    Ok((y, mean_c, var_c))
}

/// Per-channel mean and biased variance of x (N, C, *spatial), each shaped (1, C, 1, ...), two
/// passes as the kernel (the mean, then the centred squares).
fn statistics(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let reduce = batch_and_space(x.rank());
    let mean = x.mean_keepdim(reduce.as_slice())?;
    let var = x.broadcast_sub(&mean)?.sqr()?.mean_keepdim(reduce.as_slice())?;
    Ok((mean, var))
}

/// Every dimension of a (N, C, *spatial) tensor of rank `rank` but the channels.
fn batch_and_space(rank: usize) -> Vec<usize> {
    (0..rank).filter(|&d| d != 1).collect()
}

/// A (C) tensor as (1, C, 1, ...) of rank `rank`, to broadcast over batch and space.
fn channel_shaped(t: &Tensor, rank: usize) -> Result<Tensor> {
    let mut shape = vec![1; rank];
    shape[1] = t.elem_count();
    t.reshape(shape)
}

/// The sum over batch and space of x (N, C, *spatial): (C).
fn channel_sum(x: &Tensor) -> Result<Tensor> {
    x.sum(batch_and_space(x.rank()).as_slice())
}

/// ReLU that lets a NaN through, as the kernel and PyTorch (candle's `relu` makes it 0).
fn nan_relu(y: &Tensor) -> Result<Tensor> {
    let keep = y.gt(0.0)?.add(&y.ne(y)?)?; // 1 where y > 0 or y is NaN
    keep.where_cond(y, &y.zeros_like()?)
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
        // SAFETY: every element is written below.
        let mut y = unsafe { uninit(x.len()) };
        y.par_chunks_mut(self.spatial).zip(x.par_chunks(self.spatial)).enumerate().for_each(|(i, (y, x))| {
            let ch = i % self.channels;
            let (mean, scale) = (elem::<T>(self.mean[ch]), elem::<T>(self.rstd[ch]) * w[ch]);
            let r = residual.map(|r| &r[i * self.spatial..(i + 1) * self.spatial]);
            for (j, (y, &x)) in y.iter_mut().zip(x).enumerate() {
                let mut v = (x - mean) * scale + b[ch];
                if let Some(r) = r {
                    v += r[j];
                }
                // A NaN stays NaN through the ReLU, as in PyTorch (`Float::max` would make it 0,
                // and a NaN input would train on with a finite loss).
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
        let masked = |y: T, g: T| if self.relu && y <= T::zero() { 0.0 } else { wide(g) };
        // Per channel, in LANES interleaved partial sums (independent chains the compiler can
        // vectorise) added up in a fixed order: the same bits at any thread count.
        const LANES: usize = 8;
        let (db, dw): (Vec<f64>, Vec<f64>) = (0..c)
            .into_par_iter()
            .map(|ch| {
                let (mut db, mut dw, mean) = ([0f64; LANES], [0f64; LANES], self.mean[ch]);
                for bi in 0..n {
                    let at = (bi * c + ch) * s;
                    let (xs, ys, gs) = (&x[at..at + s], &y[at..at + s], &g[at..at + s]);
                    for ((x, y), g) in xs.chunks(LANES).zip(ys.chunks(LANES)).zip(gs.chunks(LANES)) {
                        for l in 0..x.len() {
                            let gi = masked(y[l], g[l]);
                            db[l] += gi;
                            dw[l] += gi * (wide(x[l]) - mean);
                        }
                    }
                }
                (db.iter().sum::<f64>(), dw.iter().sum::<f64>() * self.rstd[ch])
            })
            .unzip();
        let m = (n * s) as f64;
        // dx, and the residual's gradient g' beside it, one block (sample, channel) per task.
        let fill = |block: usize, dx: &mut [T], dr: Option<&mut [T]>| {
            let (ch, at) = (block % c, block * s);
            let (mean, rstd) = (self.mean[ch], self.rstd[ch]);
            let k = wide(wb[ch]) * rstd / m;
            let (xs, ys, gs) = (&x[at..at + s], &y[at..at + s], &g[at..at + s]);
            for (((d, &x), &y), &g) in dx.iter_mut().zip(xs).zip(ys).zip(gs) {
                *d = elem(k * (m * masked(y, g) - db[ch] - (wide(x) - mean) * rstd * dw[ch]));
            }
            if let Some(dr) = dr {
                for ((d, &y), &g) in dr.iter_mut().zip(ys).zip(gs) {
                    *d = elem(masked(y, g));
                }
            }
        };
        // SAFETY: `fill` writes every element of both.
        let (mut dx, mut dr) = unsafe { (uninit(x.len()), residual.then(|| uninit(x.len()))) };
        match dr.as_mut() {
            Some(dr) => dx.par_chunks_mut(s).zip(dr.par_chunks_mut(s)).enumerate().for_each(|(block, (dx, dr))| fill(block, dx, Some(dr))),
            None => dx.par_chunks_mut(s).enumerate().for_each(|(block, dx)| fill(block, dx, None)),
        }
        let dwb = dw.into_iter().chain(db).map(elem::<T>).collect();
        (dx, dwb, dr)
    }
}

/// Operands x, (weight; bias) and, at arity 3, the residual.
impl FusedOp for BatchNormOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let ((x, xl), (wb, wbl), residual) = (inputs[0], inputs[1], inputs.get(2));
        let y = per_float!(x, "batch_norm", self.forward(&slice(x, xl)?, &slice(wb, wbl)?, residual.map(|&(s, l)| slice(s, l)).transpose()?.as_deref()));
        Ok((y, xl.shape().clone()))
    }

    fn bwd(&self, inputs: &[&Tensor], y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let (x, wb, residual) = (inputs[0], inputs[1], inputs.len() == 3);
        let g = g.contiguous()?;
        let (dx, dwb, dr) = per_dtype!(x.dtype(), T => {
            let (dx, dwb, dr) = with_slice::<T, _>(x, |xs| with_slice(y, |ys| with_slice(wb, |ws| with_slice(&g, |gs| Ok(self.backward(xs, ys, ws, gs, residual))))))?;
            (shaped(dx, x)?, shaped(dwb, wb)?, dr.map(|dr| shaped(dr, x)).transpose()?)
        });
        Ok([Some(dx), Some(dwb), dr].into_iter().take(inputs.len()).collect())
    }
}

custom_op!(BatchNormOp: 2 "fused-batch-norm", 3 "fused-batch-norm-add");
