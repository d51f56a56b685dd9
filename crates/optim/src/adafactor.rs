//! Adafactor (Shazeer & Stern, 2018) as PyTorch's `torch.optim.Adafactor` defines it: no first
//! moment, and the second moment of a parameter with two or more axes kept factored, one
//! statistic per row and one per column of its last two axes. An R x C weight keeps R + C numbers
//! where AdamW keeps 2 R C (GPT-2 XL: about 2 MB of state instead of 12.5 GB).
//!
//! At step t, with `w = t^beta2_decay`, `rho = min(lr, 1 / sqrt(t))` and
//! `alpha = max(eps2, rms(p)) rho` (rms before the decay):
//! `p *= 1 - lr wd`; rows `r = lerp(r, mean_j g^2, w)`, columns `c = lerp(c, mean_i g^2, w)`;
//! `v_ij = r_i c_j / max(mean(r), eps1)` (a vector keeps `v = lerp(v, g^2, w)` whole);
//! `u = g / sqrt(max(v, eps1^2))`; `p -= alpha / max(1, rms(u) / d) * u`. `eps1` defaults to the
//! parameter dtype's machine epsilon, as in PyTorch.
//!
//! On the CPU a step reads the gradient three times and rewrites the parameter and its statistics
//! in place: nothing parameter-sized is allocated (PyTorch's builds `v` and `u`, two
//! parameter-sized temporaries). The statistics of a half-precision parameter are f32. Elsewhere
//! (a GPU, or the CPU on the generic route) it runs composed candle ops that hold at most three
//! temporaries of a parameter's size at once, then copy the new value into the parameter.

use crate::in_place::ParamElem;
use crate::state::{restored, state_dtype, state_zeros, StepCount};
use crate::TrainOptimizer;
use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{
    CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Result, Storage, Tensor, Var, WithDType, D,
};
use half::{bf16, f16};
use ops::fused::{fused, slice};
use rayon::prelude::*;
use std::collections::HashMap;

/// PyTorch's defaults (`torch.optim.Adafactor`).
#[derive(Clone, Copy, Debug)]
pub struct ParamsAdafactor {
    pub lr: f64,
    pub beta2_decay: f64,
    /// Floor of the variance estimate (squared) and of the row statistics' mean; `None`: the
    /// parameter dtype's machine epsilon.
    pub eps1: Option<f64>,
    /// Floor of the parameter's RMS in the step size.
    pub eps2: f64,
    /// Clipping threshold of the update's RMS.
    pub d: f64,
    pub weight_decay: f64,
}

impl Default for ParamsAdafactor {
    fn default() -> Self {
        ParamsAdafactor {
            lr: 1e-2,
            beta2_decay: -0.8,
            eps1: None,
            eps2: 1e-3,
            d: 1.0,
            weight_decay: 0.0,
        }
    }
}

pub struct Adafactor {
    vars: Vec<Factored>,
    params: ParamsAdafactor,
    step: StepCount,
    composed: bool,
}

impl Adafactor {
    /// As [`crate::AdamW::composed`]: candle ops on the CPU too, to test the other devices' path.
    pub fn composed(self) -> Self {
        Adafactor { composed: true, ..self }
    }
}

/// A parameter and its second-moment statistics.
struct Factored {
    var: Var,
    shape: Shape2,
    /// Factored: (lead, R + C), each block's R row statistics then its C column statistics.
    /// Whole: shaped like the parameter.
    stats: Tensor,
}

/// How a parameter's second moment is kept: a parameter of shape (..., R, C) as `lead` blocks of
/// R x C, or whole (fewer than two axes).
#[derive(Clone, Copy, Debug)]
enum Shape2 {
    Factored { lead: usize, r: usize, c: usize },
    Whole,
}

impl Shape2 {
    fn of(t: &Tensor) -> Self {
        match t.dims() {
            [lead @ .., r, c] => Shape2::Factored { lead: lead.iter().product(), r: *r, c: *c },
            _ => Shape2::Whole,
        }
    }
}

candle_optimizer!(Adafactor, ParamsAdafactor, |vars, params| {
    let vars = vars
        .into_iter()
        .filter(|v| v.dtype().is_float())
        .map(|var| {
            let shape = Shape2::of(var.as_tensor());
            let stats = match shape {
                Shape2::Factored { lead, r, c } => {
                    Tensor::zeros((lead, r + c), state_dtype(var.dtype()), var.device())?
                }
                Shape2::Whole => state_zeros(&var)?,
            };
            Ok(Factored { var, shape, stats })
        })
        .collect::<Result<_>>()?;
    Ok(Adafactor { vars, params, step: StepCount::default(), composed: false })
});

impl TrainOptimizer for Adafactor {
    fn begin_update(&mut self) -> Result<()> {
        self.step.begin_update()
    }

    fn update_some(&mut self, grads: &GradStore) -> Result<()> {
        let t = self.step.get() as f64;
        let ParamsAdafactor { lr, beta2_decay, eps1, eps2, d, weight_decay } = self.params;
        let w = t.powf(beta2_decay);
        let rho = lr.min(1.0 / t.sqrt());
        for Factored { var, shape, stats } in &mut self.vars {
            let Some(g) = grads.get(var) else { continue };
            let p = var.as_tensor();
            let eps1 = eps1.unwrap_or(machine_epsilon(p.dtype()));
            let n = p.elem_count() as f64;
            let lean = !self.composed
                && fused(p)
                && p.is_contiguous()
                && g.is_contiguous()
                && g.dtype() == p.dtype()
                && stats.is_contiguous();
            if lean {
                let alpha = eps2.max((sum_of_squares(p)? / n).sqrt()) * rho;
                stats.inplace_op2(g, &Statistics { shape: *shape, w })?;
                let u_rms = (update_sum_of_squares(g, stats, *shape, eps1)? / n).sqrt();
                let step_size = alpha / (u_rms / d).max(1.0);
                p.inplace_op3(
                    g,
                    stats,
                    &Apply { shape: *shape, eps1, decay: 1.0 - lr * weight_decay, step_size },
                )?;
            } else {
                // In the state dtype: a half-precision parameter is updated in f32 and rounded
                // once.
                let (p32, g) =
                    (p.detach().to_dtype(stats.dtype())?, g.detach().to_dtype(stats.dtype())?);
                let alpha = eps2
                    .max(p32.sqr()?.mean_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?.sqrt())
                    * rho;
                let (next_stats, u) = composed(&g, stats, *shape, w, eps1)?;
                drop(g);
                *stats = next_stats;
                let u_rms = u.sqr()?.mean_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?.sqrt();
                let step_size = alpha / (u_rms / d).max(1.0);
                let decayed = (p32 * (1.0 - lr * weight_decay))?;
                let next_p = (decayed - (u * step_size)?)?;
                var.set(&next_p.to_dtype(p.dtype())?)?;
            }
        }
        Ok(())
    }

    fn state(&self) -> Result<HashMap<String, Tensor>> {
        let mut out: HashMap<String, Tensor> = self
            .vars
            .iter()
            .enumerate()
            .map(|(i, f)| (format!("stats.{i}"), f.stats.clone()))
            .collect();
        self.step.save(&mut out)?;
        Ok(out)
    }

    fn set_state(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        for (i, f) in self.vars.iter_mut().enumerate() {
            f.stats = restored(state, &format!("stats.{i}"), &f.stats)?;
        }
        self.step = StepCount::restore(state)?;
        Ok(())
    }

    fn state_bytes(&self) -> u64 {
        self.vars.iter().map(|f| remat::memory::tensor_bytes(&f.stats)).sum()
    }
}

fn machine_epsilon(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => f64::EPSILON,
        DType::F16 => 2f64.powi(-10),
        DType::BF16 => 2f64.powi(-7),
        _ => f32::EPSILON as f64,
    }
}

/// `$body` with `$p` the Rust type of the parameter storage `$s` (f32, f64, bf16, f16).
macro_rules! per_param {
    ($s:expr, $what:literal, $p:ident => $body:expr) => {
        match $s.dtype() {
            DType::F32 => {
                type $p = f32;
                $body
            }
            DType::F64 => {
                type $p = f64;
                $body
            }
            DType::BF16 => {
                type $p = bf16;
                $body
            }
            DType::F16 => {
                type $p = f16;
                $body
            }
            other => {
                candle_core::bail!(concat!("adafactor ", $what, ": no {:?} parameters"), other)
            }
        }
    };
}

/// The contiguous elements of a CPU tensor as `T`, its own dtype (borrowed, never converted).
fn elements<T: WithDType, R>(t: &Tensor, f: impl FnOnce(&[T]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(s) = &*storage else {
        candle_core::bail!("adafactor: tensor is not on the CPU")
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("adafactor: tensor is not contiguous".into()))?;
    Ok(f(&s.as_slice::<T>()?[start..end]))
}

fn sum_of_squares(t: &Tensor) -> Result<f64> {
    per_param!(t, "parameter", P => {
        elements::<P, _>(t, |x| x.iter().map(|v| v.to_f64() * v.to_f64()).sum())
    })
}

/// The variance estimate of element `(i, j)` of a block from its row and column statistics.
fn variance(row: f64, col: f64, row_mean: f64, eps1: f64) -> f64 {
    (row * col / row_mean.max(eps1)).max(eps1 * eps1)
}

/// The blocks of a factored parameter: for each, its gradient (R x C, row-major) and its
/// statistics (R rows then C columns), with the mean of its row statistics.
fn blocks<'a, G: WithDType, S: WithDType>(
    g: &'a [G],
    stats: &'a [S],
    r: usize,
    c: usize,
) -> impl Iterator<Item = (&'a [G], &'a [S], f64)> {
    g.chunks(r * c)
        .zip(stats.chunks(r + c))
        .map(move |(g, s)| (g, s, s[..r].iter().map(|x| x.to_f64()).sum::<f64>() / r as f64))
}

/// The sum of squares of the update `u = g / sqrt(v)`, with the statistics already updated.
fn update_sum_of_squares(g: &Tensor, stats: &Tensor, shape: Shape2, eps1: f64) -> Result<f64> {
    fn run<G: WithDType, S: WithDType>(g: &[G], stats: &[S], shape: Shape2, eps1: f64) -> f64 {
        match shape {
            Shape2::Whole => g
                .iter()
                .zip(stats)
                .map(|(g, v)| g.to_f64() * g.to_f64() / v.to_f64().max(eps1 * eps1))
                .sum(),
            Shape2::Factored { r, c, .. } => blocks(g, stats, r, c)
                .map(|(g, s, row_mean)| {
                    let (rows, cols) = s.split_at(r);
                    g.chunks(c)
                        .zip(rows)
                        .map(|(g, row)| {
                            g.iter()
                                .zip(cols)
                                .map(|(g, col)| {
                                    g.to_f64() * g.to_f64()
                                        / variance(row.to_f64(), col.to_f64(), row_mean, eps1)
                                })
                                .sum::<f64>()
                        })
                        .sum::<f64>()
                })
                .sum(),
        }
    }
    per_param!(g, "gradient", P => {
        elements::<P, _>(g, |g| {
            elements::<<P as ParamElem>::State, _>(stats, |s| run(g, s, shape, eps1))
        })?
    })
}

/// Moves the statistics (the destination) toward this step's squared gradient (the operand).
struct Statistics {
    shape: Shape2,
    w: f64,
}

impl Statistics {
    fn run<S: WithDType, G: WithDType>(&self, stats: &mut [S], g: &[G]) {
        let lerp = |s: &mut S, x: f64| *s = S::from_f64(s.to_f64() + self.w * (x - s.to_f64()));
        match self.shape {
            Shape2::Whole => {
                stats.iter_mut().zip(g).for_each(|(s, g)| lerp(s, g.to_f64() * g.to_f64()))
            }
            Shape2::Factored { r, c, .. } => {
                for (s, g) in stats.chunks_mut(r + c).zip(g.chunks(r * c)) {
                    let mut col_sums = vec![0f64; c];
                    let (rows, cols) = s.split_at_mut(r);
                    for (row, g) in rows.iter_mut().zip(g.chunks(c)) {
                        let mut sum = 0f64;
                        for (col_sum, g) in col_sums.iter_mut().zip(g) {
                            let sq = g.to_f64() * g.to_f64();
                            sum += sq;
                            *col_sum += sq;
                        }
                        lerp(row, sum / c as f64);
                    }
                    cols.iter_mut().zip(col_sums).for_each(|(col, sum)| lerp(col, sum / r as f64));
                }
            }
        }
    }
}

impl InplaceOp2 for Statistics {
    fn name(&self) -> &'static str {
        "adafactor-statistics"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let (start, end) = l1.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg("adafactor: statistics not contiguous".into())
        })?;
        // The gradient in its own dtype (`slice` borrows it), the statistics in its state dtype.
        match (s1, s2.dtype()) {
            (CpuStorage::F32(s), DType::F32) => {
                self.run(&mut s[start..end], &slice::<f32>(s2, l2)?)
            }
            (CpuStorage::F32(s), DType::BF16) => {
                self.run(&mut s[start..end], &slice::<bf16>(s2, l2)?)
            }
            (CpuStorage::F32(s), DType::F16) => {
                self.run(&mut s[start..end], &slice::<f16>(s2, l2)?)
            }
            (CpuStorage::F64(s), DType::F64) => {
                self.run(&mut s[start..end], &slice::<f64>(s2, l2)?)
            }
            (s, g) => {
                candle_core::bail!("adafactor: no {:?} statistics for {g:?} gradients", s.dtype())
            }
        }
        Ok(())
    }
}

/// The parameter update (the destination), from the gradient and the updated statistics.
struct Apply {
    shape: Shape2,
    eps1: f64,
    /// `1 - lr * weight_decay`.
    decay: f64,
    /// `alpha / max(1, rms(u) / d)`.
    step_size: f64,
}

impl Apply {
    fn run<P: ParamElem>(&self, p: &mut [P], g: &[P], stats: &[P::State]) {
        let update = |p: &mut P, g: &P, v: f64| {
            *p = P::from_f64(p.to_f64() * self.decay - self.step_size * g.to_f64() / v.sqrt())
        };
        match self.shape {
            Shape2::Whole => p
                .par_iter_mut()
                .zip(g.par_iter().zip(stats))
                .for_each(|(p, (g, v))| update(p, g, v.to_f64().max(self.eps1 * self.eps1))),
            Shape2::Factored { r, c, .. } => {
                let means: Vec<f64> = blocks(g, stats, r, c).map(|(_, _, m)| m).collect();
                p.par_chunks_mut(c).zip(g.par_chunks(c)).enumerate().for_each(|(k, (p, g))| {
                    let (block, i) = (k / r, k % r);
                    let s = &stats[block * (r + c)..(block + 1) * (r + c)];
                    let row = s[i].to_f64();
                    for ((p, g), col) in p.iter_mut().zip(g).zip(&s[r..]) {
                        update(p, g, variance(row, col.to_f64(), means[block], self.eps1));
                    }
                });
            }
        }
    }
}

impl InplaceOp3 for Apply {
    fn name(&self) -> &'static str {
        "adafactor-apply"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<()> {
        let (start, end) = l1
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("adafactor: parameter not contiguous".into()))?;
        match s1 {
            CpuStorage::F32(p) => self.run(&mut p[start..end], &slice(s2, l2)?, &slice(s3, l3)?),
            CpuStorage::F64(p) => self.run(&mut p[start..end], &slice(s2, l2)?, &slice(s3, l3)?),
            CpuStorage::BF16(p) => self.run(&mut p[start..end], &slice(s2, l2)?, &slice(s3, l3)?),
            CpuStorage::F16(p) => self.run(&mut p[start..end], &slice(s2, l2)?, &slice(s3, l3)?),
            p => candle_core::bail!("adafactor: no {:?} parameters", p.dtype()),
        }
        Ok(())
    }
}

/// The step in candle ops, for any device and dtype: the next statistics and the update `u`.
/// Each temporary goes as soon as it is used (a chained expression would keep every intermediate
/// to the end of its statement), so at most two of the gradient's size are alive beside it.
fn composed(
    g: &Tensor,
    stats: &Tensor,
    shape: Shape2,
    w: f64,
    eps1: f64,
) -> Result<(Tensor, Tensor)> {
    match shape {
        Shape2::Whole => {
            let v = lerp(stats, g.sqr()?, w)?;
            let u = (g / rms(v.clone(), eps1)?)?;
            Ok((v, u))
        }
        Shape2::Factored { lead, r, c } => {
            let g3 = g.reshape((lead, r, c))?;
            let sq = g3.sqr()?;
            let rows = lerp(&stats.narrow(1, 0, r)?, sq.mean(D::Minus1)?, w)?; // (lead, R)
            let cols = lerp(&stats.narrow(1, r, c)?, sq.mean(1)?, w)?; // (lead, C)
            drop(sq);
            // (lead, 1, 1)
            let row_mean = rows.mean_keepdim(1)?.clamp(eps1, f64::INFINITY)?.unsqueeze(2)?;
            let outer = rows.unsqueeze(2)?.broadcast_mul(&cols.unsqueeze(1)?)?; // (lead, R, C)
            let v = outer.broadcast_div(&row_mean)?;
            drop(outer);
            let u = (g3 / rms(v, eps1)?)?.reshape(g.shape())?;
            Ok((Tensor::cat(&[rows, cols], 1)?, u))
        }
    }
}

/// `s + (x - s) w`, dropping `x` and each intermediate once used.
fn lerp(s: &Tensor, x: Tensor, w: f64) -> Result<Tensor> {
    let diff = (&x - s)?;
    drop(x);
    s + (diff * w)?
}

/// `sqrt(max(v, eps1^2))`, dropping `v` once used.
fn rms(v: Tensor, eps1: f64) -> Result<Tensor> {
    let clamped = v.clamp(eps1 * eps1, f64::INFINITY)?;
    drop(v);
    clamped.sqrt()
}
