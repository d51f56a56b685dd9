//! BatchNorm in training mode, optionally with the residual and ReLU that follow it: keeps its
//! input and output (a composed BatchNorm + ReLU keeps 7 tensors of that size). A downsampling
//! residual block's end, two BatchNorms added and a ReLU, is one op too: it keeps both inputs and
//! the output, never the projection's normalised tensor.

use super::generic::{generic, GenericOp};
use super::{
    elem, exactly, operand, shaped, slice, uninit, wide, widened, widened_as, with_slice, Elem,
    FusedOp, Operand,
};
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
pub fn batch_norm_train(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    residual: Option<&Tensor>,
    eps: f64,
    relu: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    if let Some(r) = residual.filter(|r| r.shape() != x.shape()) {
        candle_core::bail!(
            "batch_norm: residual {:?} does not match the input {:?}",
            r.dims(),
            x.dims()
        )
    }
    if generic(x) {
        return batch_norm_generic(x, weight, bias, residual, eps, relu);
    }
    let x = x.contiguous()?;
    let (op, stats) = BatchNormOp::of(&x, eps, relu)?;
    // Weight and bias travel as one (2, C) operand so that the residual fits a three-input op.
    let wb = operand(&Tensor::stack(&[weight, bias], 0)?, &x)?;
    let y = match residual {
        Some(r) => x.apply_op3(&wb, &r.to_dtype(x.dtype())?.contiguous()?, op)?,
        None => x.apply_op2(&wb, op)?,
    };
    Ok((y, stats.0, stats.1))
}

/// A BatchNorm's input, weight and bias.
pub type Normalised<'a> = (&'a Tensor, &'a Tensor, &'a Tensor);

/// `relu(bn(x) + bn'(x'))` in training mode, for `a` = (x, weight, bias) and `b` = (x', weight',
/// bias') of one shape (a downsampling residual block's end: its last BatchNorm and the
/// projection's). One op, keeping x, x' and the output: composed of [`batch_norm_train`] with a
/// residual, the projection's normalised tensor would be kept as the residual operand (PyTorch
/// keeps none either). The same bits as that composition. Returns the output and each one's
/// per-channel batch mean and biased variance.
pub fn batch_norm_pair_train(
    a: Normalised,
    b: Normalised,
    eps: f64,
) -> Result<(Tensor, [(Tensor, Tensor); 2])> {
    if a.0.shape() != b.0.shape() {
        candle_core::bail!("batch_norm_pair: inputs {:?} and {:?} differ", a.0.dims(), b.0.dims())
    }
    if generic(a.0) {
        return batch_norm_pair_generic(a, b, eps);
    }
    let (xa, xb) = (a.0.contiguous()?, b.0.to_dtype(a.0.dtype())?.contiguous()?);
    let ((first, stats_a), (second, stats_b)) =
        (BatchNormOp::of(&xa, eps, true)?, BatchNormOp::of(&xb, eps, false)?);
    let wb = operand(&Tensor::stack(&[a.1, a.2, b.1, b.2], 0)?, &xa)?; // (4, C)
    let y = xa.apply_op3(&xb, &wb, BatchNormPairOp { first, second })?;
    Ok((y, [stats_a, stats_b]))
}

/// The generic route ([`super::generic`]): the statistics and the output composed on detached
/// operands in f32 (f64 for f64), and the kernel's backward formula composed, the statistics
/// recomputed from the input. Keeps what the kernel keeps: x, (weight; bias), the residual.
fn batch_norm_generic(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    residual: Option<&Tensor>,
    eps: f64,
    relu: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let wb = Tensor::stack(&[weight, bias], 0)?; // (2, C): the op's operand, as on the kernel
    let residual_w = residual.map(|r| widened_as(&r.detach(), x)).transpose()?;
    let (y, mean, var) =
        normalise(x, &widened_as(&wb.detach(), x)?, residual_w.as_ref(), eps, relu)?;
    let backward = move |inputs: &[Tensor],
                         y: &Tensor,
                         g: &Tensor,
                         _want: &[bool]|
          -> Result<Vec<Option<Tensor>>> {
        let (x, wb) = (&inputs[0], &inputs[1]);
        let (dx, dwb, masked) =
            normalise_backward(x, &widened_as(wb, x)?, y, &widened_as(g, x)?, eps, relu)?;
        let dr = if inputs.len() == 3 { Some(masked.to_dtype(inputs[2].dtype())?) } else { None };
        Ok([Some(dx.to_dtype(x.dtype())?), Some(dwb.to_dtype(wb.dtype())?), dr]
            .into_iter()
            .take(inputs.len())
            .collect())
    };
    let op = GenericOp::new(
        if residual.is_some() { "generic-batch-norm-add" } else { "generic-batch-norm" },
        y,
        Box::new(backward),
    );
    let y = match residual {
        Some(r) => x.contiguous()?.apply_op3(&wb, &r.contiguous()?, op)?,
        None => x.contiguous()?.apply_op2(&wb, op)?,
    };
    Ok((y, mean, var))
}

/// [`batch_norm_pair_train`]'s generic route: [`batch_norm_generic`]'s composition twice in one
/// op, keeping what the kernel keeps: x, x' and (weight; bias; weight'; bias').
fn batch_norm_pair_generic(
    a: Normalised,
    b: Normalised,
    eps: f64,
) -> Result<(Tensor, [(Tensor, Tensor); 2])> {
    let wb = Tensor::stack(&[a.1, a.2, b.1, b.2], 0)?; // (4, C), as on the kernel
    let wb_w = widened_as(&wb.detach(), a.0)?;
    let (r, mean_b, var_b) = normalise(b.0, &wb_w.narrow(0, 2, 2)?, None, eps, false)?;
    let (y, mean_a, var_a) =
        normalise(a.0, &wb_w.narrow(0, 0, 2)?, Some(&widened_as(&r, a.0)?), eps, true)?;
    let backward = move |inputs: &[Tensor],
                         y: &Tensor,
                         g: &Tensor,
                         _want: &[bool]|
          -> Result<Vec<Option<Tensor>>> {
        let (xa, xb, wb) = (&inputs[0], &inputs[1], &inputs[2]);
        let wb_w = widened_as(wb, xa)?;
        let (dxa, dwb_a, masked) =
            normalise_backward(xa, &wb_w.narrow(0, 0, 2)?, y, &widened_as(g, xa)?, eps, true)?;
        let (dxb, dwb_b, _) =
            normalise_backward(xb, &wb_w.narrow(0, 2, 2)?, y, &masked, eps, false)?;
        let dwb = Tensor::cat(&[dwb_a, dwb_b], 0)?.to_dtype(wb.dtype())?;
        Ok(vec![Some(dxa.to_dtype(xa.dtype())?), Some(dxb.to_dtype(xb.dtype())?), Some(dwb)])
    };
    let op = GenericOp::new("generic-batch-norm-pair", y, Box::new(backward));
    let y = a.0.contiguous()?.apply_op3(&b.0.contiguous()?, &wb, op)?;
    Ok((y, [(mean_a, var_a), (mean_b, var_b)]))
}

/// The generic route's forward on the detached x: `bn(x) (+ residual)`, then a ReLU if `relu`,
/// with `wb_w` (weight; bias) and the residual already in the compute dtype; the output in x's
/// dtype, and the per-channel mean and biased variance (C).
fn normalise(
    x: &Tensor,
    wb_w: &Tensor,
    residual_w: Option<&Tensor>,
    eps: f64,
    relu: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let xw = widened(&x.detach())?;
    let (mean, var) = statistics(&xw)?;
    let rstd = (&var + eps)?.sqrt()?.recip()?;
    let (w, b) =
        (channel_shaped(&wb_w.get(0)?, x.rank())?, channel_shaped(&wb_w.get(1)?, x.rank())?);
    let mut y =
        xw.broadcast_sub(&mean)?.broadcast_mul(&(rstd.broadcast_mul(&w))?)?.broadcast_add(&b)?;
    if let Some(r) = residual_w {
        y = (y + r)?;
    }
    if relu {
        y = nan_relu(&y)?;
    }
    Ok((y.to_dtype(x.dtype())?, mean.flatten_all()?, var.flatten_all()?))
}

/// The kernel's backward formula composed, for the output y and its gradient g (in the compute
/// dtype): dx (compute dtype), d(weight; bias) (2, C), and g masked by the ReLU (the residual's
/// gradient).
fn normalise_backward(
    x: &Tensor,
    wb_w: &Tensor,
    y: &Tensor,
    g: &Tensor,
    eps: f64,
    relu: bool,
) -> Result<(Tensor, Tensor, Tensor)> {
    let xw = widened(x)?;
    // A NaN output passes its gradient, as in the kernel.
    let g = if relu { y.le(0.0)?.where_cond(&g.zeros_like()?, g)? } else { g.clone() };
    let (mean, var) = statistics(&xw)?;
    let rstd = (var + eps)?.sqrt()?.recip()?;
    let x_hat = xw.broadcast_sub(&mean)?.broadcast_mul(&rstd)?;
    let db = channel_sum(&g)?;
    let dw = channel_sum(&(&g * &x_hat)?)?;
    let m = (x.elem_count() / x.dim(1)?) as f64;
    let w = channel_shaped(&wb_w.get(0)?, x.rank())?;
    let (db_m, dw_m) =
        (channel_shaped(&(&db / m)?, x.rank())?, channel_shaped(&(&dw / m)?, x.rank())?);
    let dx = g
        .broadcast_sub(&db_m)?
        .sub(&x_hat.broadcast_mul(&dw_m)?)?
        .broadcast_mul(&(rstd.broadcast_mul(&w))?)?;
    Ok((dx, Tensor::stack(&[dw, db], 0)?, g))
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
    let m = (x.len() / c) as f64;
    (0..c)
        .into_par_iter()
        .map(|ch| {
            let mut sum = Lanes::<1>::default();
            channel_blocks(x, ch, c, s).for_each(|x| sum.add([x], |[x]| [wide(x)]));
            let mean = sum.total()[0] / m;
            let mut squares = Lanes::<1>::default();
            channel_blocks(x, ch, c, s)
                .for_each(|x| squares.add([x], |[x]| [(wide(x) - mean) * (wide(x) - mean)]));
            (mean, squares.total()[0] / m)
        })
        .unzip()
}

/// Channel `ch`'s blocks of (N, C, S) data, one per sample, in order.
fn channel_blocks<T>(t: &[T], ch: usize, c: usize, s: usize) -> impl Iterator<Item = &[T]> {
    t.chunks_exact(c * s).map(move |sample| &sample[ch * s..][..s])
}

/// `K` running sums in f64, each as [`LANES`] interleaved partial sums (independent chains the
/// compiler vectorises, where one running sum waits for each addition in turn) added in a fixed
/// order at the end: the same bits at any thread count.
struct Lanes<const K: usize>([[f64; LANES]; K]);

const LANES: usize = 16;

impl<const K: usize> Default for Lanes<K> {
    fn default() -> Self {
        Lanes([[0.0; LANES]; K])
    }
}

impl<const K: usize> Lanes<K> {
    /// Adds `term` of the elements at each position of the equally long `inputs`.
    fn add<T: Elem, const M: usize>(
        &mut self,
        inputs: [&[T]; M],
        term: impl Fn([T; M]) -> [f64; K],
    ) {
        let len = inputs[0].len();
        let inputs = inputs.map(|v| &v[..len]);
        let full = len / LANES;
        for i in 0..full {
            let chunk = inputs.map(|v| &v[i * LANES..][..LANES]);
            for l in 0..LANES {
                let t = term(chunk.map(|v| v[l]));
                (0..K).for_each(|k| self.0[k][l] += t[k]);
            }
        }
        for (l, j) in (full * LANES..len).enumerate() {
            let t = term(inputs.map(|v| v[j]));
            (0..K).for_each(|k| self.0[k][l] += t[k]);
        }
    }

    fn total(&self) -> [f64; K] {
        self.0.map(|lanes| lanes.iter().sum())
    }
}

#[derive(Clone)]
struct BatchNormOp {
    mean: Vec<f64>,
    rstd: Vec<f64>,
    relu: bool,
    channels: usize,
    spatial: usize,
}

impl BatchNormOp {
    /// The op for the contiguous x (N, C, *spatial) with its batch statistics, and those as the
    /// per-channel mean and biased variance tensors (C) (for the running statistics).
    fn of(x: &Tensor, eps: f64, relu: bool) -> Result<(Self, (Tensor, Tensor))> {
        let (n, c) = (x.dim(0)?, x.dim(1)?);
        let spatial = x.elem_count() / (n * c).max(1);
        let (mean, var) = per_dtype!(x.dtype(), T => {
            with_slice::<T, _>(x, |xs| Ok(channel_stats(xs, c, spatial)))?
        });
        let rstd = var.iter().map(|v| 1.0 / (v + eps).sqrt()).collect();
        let per_channel = |v: Vec<f64>| Tensor::from_vec(v, c, x.device());
        let stats = (per_channel(mean.clone())?, per_channel(var)?);
        Ok((BatchNormOp { mean, rstd, relu, channels: c, spatial }, stats))
    }

    /// `wb` is (2, C): weight then bias.
    fn forward<T: Elem>(&self, x: &[T], wb: &[T], residual: Option<&[T]>) -> Vec<T> {
        let (w, b) = wb.split_at(self.channels);
        // SAFETY: every element is written below.
        let mut y = unsafe { uninit(x.len()) };
        y.par_chunks_mut(self.spatial).zip(x.par_chunks(self.spatial)).enumerate().for_each(
            |(i, (y, x))| {
                let ch = i % self.channels;
                let (mean, scale) = (elem::<T>(self.mean[ch]), elem::<T>(self.rstd[ch]) * w[ch]);
                let r = residual.map(|r| &r[i * self.spatial..(i + 1) * self.spatial]);
                for (j, (y, &x)) in y.iter_mut().zip(x).enumerate() {
                    let mut v = (x - mean) * scale + b[ch];
                    if let Some(r) = r {
                        v += r[j];
                    }
                    // A NaN stays NaN through the ReLU, as in PyTorch (`Float::max` would make it
                    // 0, and a NaN input would train on with a finite loss).
                    *y = if self.relu && !v.is_nan() { Float::max(v, T::zero()) } else { v };
                }
            },
        );
        y
    }

    /// With g' = g (masked by y > 0 after a ReLU) and x_hat the normalised input, per channel:
    /// db = sum g', dw = sum g' x_hat, dx = w rstd / M (M g' - db - x_hat dw); the residual's
    /// gradient is g'. Returns dx, d(weight, bias) as (2, C), and g' (None without a residual).
    fn backward<T: Elem>(
        &self,
        x: &[T],
        y: &[T],
        wb: &[T],
        g: &[T],
        residual: bool,
    ) -> (Vec<T>, Vec<T>, Option<Vec<T>>) {
        let (c, s) = (self.channels, self.spatial);
        let n = x.len() / (c * s);
        let masked = |y: T, g: T| if self.relu && y <= T::zero() { 0.0 } else { wide(g) };
        let (db, dw): (Vec<f64>, Vec<f64>) = (0..c)
            .into_par_iter()
            .map(|ch| {
                let (mut sums, mean) = (Lanes::<2>::default(), self.mean[ch]);
                let blocks = |t| channel_blocks(t, ch, c, s);
                for ((x, y), g) in blocks(x).zip(blocks(y)).zip(blocks(g)) {
                    sums.add([x, y, g], |[x, y, g]| {
                        let g = masked(y, g);
                        [g, g * (wide(x) - mean)]
                    });
                }
                let [db, dw] = sums.total();
                (db, dw * self.rstd[ch])
            })
            .unzip();
        let m = (n * s) as f64;
        // dx, and the residual's gradient g' beside it, one block (sample, channel) per task.
        let fill = |block: usize, dx: &mut [T], dr: Option<&mut [T]>| {
            let (ch, at) = (block % c, block * s);
            let (mean, rstd) = (self.mean[ch], self.rstd[ch]);
            // k (m g' - db - (x - mean) rstd dw) with k = w rstd / m, as a g' - b (x - mean) - d
            let k = wide(wb[ch]) * rstd / m;
            let (a, b, d) = (k * m, k * rstd * dw[ch], k * db[ch]);
            let (xs, ys, gs) = (&x[at..at + s], &y[at..at + s], &g[at..at + s]);
            for (((dx, &x), &y), &g) in dx.iter_mut().zip(xs).zip(ys).zip(gs) {
                *dx = elem(a * masked(y, g) - b * (wide(x) - mean) - d);
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
            Some(dr) => dx
                .par_chunks_mut(s)
                .zip(dr.par_chunks_mut(s))
                .enumerate()
                .for_each(|(block, (dx, dr))| fill(block, dx, Some(dr))),
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
        let y = per_float!(
            x,
            "batch_norm",
            self.forward(
                &slice(x, xl)?,
                &slice(wb, wbl)?,
                residual.map(|&(s, l)| slice(s, l)).transpose()?.as_deref()
            )
        );
        Ok((y, xl.shape().clone()))
    }

    fn bwd(&self, inputs: &[&Tensor], y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let (x, wb, residual) = (inputs[0], inputs[1], inputs.len() == 3);
        let g = g.contiguous()?;
        let (dx, dwb, dr) = per_dtype!(x.dtype(), T => {
            let (dx, dwb, dr) = with_slice::<T, _>(x, |xs| {
                with_slice(y, |ys| {
                    with_slice(wb, |ws| {
                        with_slice(&g, |gs| Ok(self.backward(xs, ys, ws, gs, residual)))
                    })
                })
            })?;
            (shaped(dx, x)?, shaped(dwb, wb)?, dr.map(|dr| shaped(dr, x)).transpose()?)
        });
        Ok([Some(dx), Some(dwb), dr].into_iter().take(inputs.len()).collect())
    }
}

custom_op!(BatchNormOp: 2 "fused-batch-norm", 3 "fused-batch-norm-add");

/// `relu(first(x) + second(x'))`: the first BatchNorm with the ReLU, the second without.
struct BatchNormPairOp {
    first: BatchNormOp,
    second: BatchNormOp,
}

/// Operands x, x' and (weight; bias; weight'; bias') (4, C). Forward and backward are the two
/// BatchNorms' own, as when the second's output is the first's residual: the same bits.
impl FusedOp for BatchNormPairOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let [(x, xl), (x2, x2l), (wb, wbl)] = exactly(inputs)?;
        let c = self.first.channels;
        let y = per_float!(x, "batch_norm_pair", {
            let wb = slice(wb, wbl)?;
            let residual = self.second.forward(&slice(x2, x2l)?, &wb[2 * c..], None); // transient
            self.first.forward(&slice(x, xl)?, &wb[..2 * c], Some(&residual))
        });
        Ok((y, xl.shape().clone()))
    }

    fn bwd(&self, inputs: &[&Tensor], y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [x, x2, wb] = exactly(inputs)?;
        let (g, c) = (g.contiguous()?, self.first.channels);
        let (dx, dx2, dwb) = per_dtype!(x.dtype(), T => {
            let backward = |xs: &[T], x2s: &[T], ys: &[T], ws: &[T], gs: &[T]| {
                let (dx, dwb, _) = self.first.backward(xs, ys, &ws[..2 * c], gs, false);
                // The second's gradient is g masked by the output's ReLU: its backward masks g
                // itself, as the first's does, rather than reading a masked copy.
                let second = BatchNormOp { relu: true, ..self.second.clone() };
                let (dx2, dwb2, _) = second.backward(x2s, ys, &ws[2 * c..], gs, false);
                (dx, dx2, dwb.into_iter().chain(dwb2).collect::<Vec<T>>())
            };
            let (dx, dx2, dwb) = with_slice::<T, _>(x, |xs| {
                with_slice(x2, |x2s| {
                    with_slice(y, |ys| {
                        with_slice(wb, |ws| with_slice(&g, |gs| Ok(backward(xs, x2s, ys, ws, gs))))
                    })
                })
            })?;
            (shaped(dx, x)?, shaped(dx2, x2)?, shaped(dwb, wb)?)
        });
        Ok(vec![Some(dx), Some(dx2), Some(dwb)])
    }
}

custom_op!(BatchNormPairOp: 3 "fused-batch-norm-pair");
