//! BatchNorm's CPU kernel: the batch statistics per channel in f64, summed in a fixed order
//! whatever the threads; the forward and backward one pass each over (sample, channel) blocks;
//! and the pair of BatchNorms added and a ReLU (a downsampling block's end) as one op. Keeps its
//! input and output. Not here: the device-generic route (`generic`), the running statistics (the
//! `BatchNorm` layer).

use super::Activation;
use crate::fused::elem::{elem, wide, Elem};
use crate::fused::op::{exactly, FusedOp, Operand};
use crate::fused::storage::{shaped, slice, with_slice};
use crate::fused::uninit::uninit;
use candle_core::{CpuStorage, Result, Shape, Tensor};
use num_traits::Float;
use rayon::prelude::*;

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
pub(crate) struct BatchNormOp {
    mean: Vec<f64>,
    rstd: Vec<f64>,
    activation: Activation,
    channels: usize,
    spatial: usize,
}

impl BatchNormOp {
    /// The op for the contiguous x (N, C, *spatial) with its batch statistics, and those as the
    /// per-channel mean and biased variance tensors (C) (for the running statistics).
    pub(crate) fn of(
        x: &Tensor,
        eps: f64,
        activation: Activation,
    ) -> Result<(Self, (Tensor, Tensor))> {
        let (n, c) = (x.dim(0)?, x.dim(1)?);
        let spatial = x.elem_count() / (n * c).max(1);
        let (mean, var) = per_dtype!(x.dtype(), T => {
            with_slice::<T, _>(x, |xs| Ok(channel_stats(xs, c, spatial)))?
        });
        let rstd = var.iter().map(|v| 1.0 / (v + eps).sqrt()).collect();
        let per_channel = |v: Vec<f64>| Tensor::from_vec(v, c, x.device());
        let stats = (per_channel(mean.clone())?, per_channel(var)?);
        Ok((BatchNormOp { mean, rstd, activation, channels: c, spatial }, stats))
    }

    /// `wb` is (2, C): weight then bias.
    pub(crate) fn forward<T: Elem>(&self, x: &[T], wb: &[T], residual: Option<&[T]>) -> Vec<T> {
        let (w, b) = wb.split_at(self.channels);
        let relu = self.activation == Activation::Relu;
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
                    *y = if relu && !v.is_nan() { Float::max(v, T::zero()) } else { v };
                }
            },
        );
        y
    }

    /// With g' = g (masked by y > 0 after a ReLU) and x_hat the normalised input, per channel:
    /// db = sum g', dw = sum g' x_hat, dx = w rstd / M (M g' - db - x_hat dw); the residual's
    /// gradient is g'. Returns dx, d(weight, bias) as (2, C), and g' (None without a residual).
    pub(crate) fn backward<T: Elem>(
        &self,
        x: &[T],
        y: &[T],
        wb: &[T],
        g: &[T],
        residual: bool,
    ) -> (Vec<T>, Vec<T>, Option<Vec<T>>) {
        let (c, s) = (self.channels, self.spatial);
        let n = x.len() / (c * s);
        let relu = self.activation == Activation::Relu;
        let masked = |y: T, g: T| if relu && y <= T::zero() { 0.0 } else { wide(g) };
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
pub(super) struct BatchNormPairOp {
    pub(super) first: BatchNormOp,
    pub(super) second: BatchNormOp,
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
                let second = BatchNormOp { activation: Activation::Relu, ..self.second.clone() };
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
