//! `optim`: optimizers that update in place ([`AdamW`], [`SgdMomentum`], [`Adafactor`]): each
//! parameter and its state are rewritten element by element, so an update allocates nothing
//! parameter-sized. candle-nn's AdamW builds six parameter-sized temporaries per parameter, which
//! made the optimizer, not the activations, set the step's peak for the transformers here.
//!
//! The state (moments, factored statistics) is kept in f32 for half-precision parameters (`--dtype
//! bf16-weights`: bf16 weights and gradients, f32 moments) and in the parameter's dtype otherwise.
//! On the CPU an update is one pass over a parameter, its state and its gradient, reading and
//! writing each once (three passes, one per tensor, would move twice the bytes), computed in the
//! state dtype as PyTorch computes it and split over threads (each element's update is independent,
//! so the bits do not depend on the thread count). Elsewhere (a GPU, or the CPU on the generic
//! route) they are composed from candle ops that drop each temporary once used, at most three of a
//! parameter's size alive at once, and the new value is copied into the parameter's storage
//! (`Var::set`).
//!
//! Not here: which optimizer a run picks by name (the `model` crate's `OptimizerKind`), the
//! parameters themselves (`params`).

/// candle-nn's `Optimizer` for one of ours, each written once: `new` builds it from its variables
/// and parameters (`$new`), a step is [`TrainOptimizer::update`], and the learning rate is its
/// parameters' `lr`.
macro_rules! candle_optimizer {
    ($ty:ty, $params:ty, |$vars:ident, $p:ident| $new:block) => {
        impl candle_nn::Optimizer for $ty {
            type Config = $params;

            fn new($vars: Vec<candle_core::Var>, $p: $params) -> candle_core::Result<Self> $new

            fn step(
                &mut self,
                grads: &candle_core::backprop::GradStore,
            ) -> candle_core::Result<()> {
                $crate::TrainOptimizer::update(self, grads)
            }

            fn learning_rate(&self) -> f64 {
                self.params.lr
            }

            fn set_learning_rate(&mut self, lr: f64) {
                self.params.lr = lr;
            }
        }
    };
}

mod adafactor;

pub use adafactor::{Adafactor, ParamsAdafactor};

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Result, Storage, Tensor, Var, WithDType};
pub use candle_nn::ParamsAdamW;
use half::{bf16, f16};
use num_traits::Float;
use ops::fused::slice;
use rayon::prelude::*;
use remat::memory::tensor_bytes;
use std::cell::Cell;
use std::collections::HashMap;

/// Elements per task of an in-place update.
const CHUNK: usize = 1 << 15;

/// The dtype an optimizer keeps a parameter's state in: f32 for a half-precision parameter,
/// the parameter's own otherwise.
pub(crate) fn state_dtype(param: DType) -> DType {
    if ops::fused::is_half(param) {
        DType::F32
    } else {
        param
    }
}

/// Zeros shaped like `var`, in its state dtype.
pub(crate) fn state_zeros(var: &Var) -> Result<Tensor> {
    Tensor::zeros(var.shape(), state_dtype(var.dtype()), var.device())
}

/// A float element type of parameters on the CPU and the element type of their state.
pub(crate) trait ParamElem: WithDType {
    type State: ParamElem<State = Self::State> + Float;
    fn to_state(self) -> Self::State;
    fn from_state(s: Self::State) -> Self;
    /// The elements of `s` if it holds this type.
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
}

macro_rules! param_elem {
    ($t:ty, $variant:ident, $state:ty, $to:expr, $from:expr) => {
        impl ParamElem for $t {
            type State = $state;
            fn to_state(self) -> $state {
                $to(self)
            }
            fn from_state(s: $state) -> Self {
                $from(s)
            }
            fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
                match s {
                    CpuStorage::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}

param_elem!(f32, F32, f32, std::convert::identity, std::convert::identity);
param_elem!(f64, F64, f64, std::convert::identity, std::convert::identity);
param_elem!(bf16, BF16, f32, bf16::to_f32, bf16::from_f32);
param_elem!(f16, F16, f32, f16::to_f32, f16::from_f32);

/// An optimizer's update of one element, computed in the state dtype `S` (f32 for f32 and
/// half-precision parameters, as PyTorch computes it): from the parameter `p`, its `N` state
/// values (updated in place) and its gradient `g`, the new parameter.
trait Rule<const N: usize>: Sync {
    fn at<S: Float + Send + Sync>(&self) -> impl Fn(S, [&mut S; N], S) -> S + Sync;
}

/// Runs `f` with write access to the CPU storage of `t` (candle's in-place op, for its lock: a
/// closure where candle wants an op type), so that one pass can write several tensors.
fn with_storage_mut(t: &Tensor, f: impl FnOnce(&mut CpuStorage) -> Result<()>) -> Result<()> {
    struct Locked<F>(Cell<Option<F>>);
    impl<F: FnOnce(&mut CpuStorage) -> Result<()>> InplaceOp1 for Locked<F> {
        fn name(&self) -> &'static str {
            "optimizer-update"
        }
        fn cpu_fwd(&self, s: &mut CpuStorage, _: &Layout) -> Result<()> {
            self.0.take().expect("an in-place op runs once")(s)
        }
    }
    t.inplace_op1(&Locked(Cell::new(Some(f))))
}

/// Runs `f` on the storages of `ts`, each locked for writing, in order.
fn with_storages_mut(
    ts: &[&Tensor],
    held: Vec<&mut CpuStorage>,
    f: &mut dyn FnMut(Vec<&mut CpuStorage>) -> Result<()>,
) -> Result<()> {
    let Some((t, rest)) = ts.split_first() else { return f(held) };
    with_storage_mut(t, move |s| {
        let mut held: Vec<&mut CpuStorage> = held;
        held.push(s);
        with_storages_mut(rest, held, f)
    })
}

/// `rule` over every element of a contiguous `p`, its state and `g`, split over threads (each
/// element's update is independent, so the bits do not depend on the thread count).
fn run<P: ParamElem, const N: usize>(
    rule: &(impl Fn(P::State, [&mut P::State; N], P::State) -> P::State + Sync),
    p: &mut [P],
    state: [&mut [P::State]; N],
    g: &[P],
) {
    let n = p.len();
    if n > CHUNK {
        let mid = n / 2;
        let (p0, p1) = p.split_at_mut(mid);
        let (g0, g1) = g.split_at(mid);
        let mut halves = state.map(|s| {
            let (lo, hi) = s.split_at_mut(mid);
            (Some(lo), Some(hi))
        });
        let lo = std::array::from_fn(|k| halves[k].0.take().expect("split above"));
        let hi = std::array::from_fn(|k| halves[k].1.take().expect("split above"));
        rayon::join(|| run(rule, p0, lo, g0), || run(rule, p1, hi, g1));
        return;
    }
    let (g, mut state) = (&g[..n], state.map(|s| &mut s[..n]));
    for i in 0..n {
        p[i] = P::from_state(rule(
            p[i].to_state(),
            state.each_mut().map(|s| &mut s[i]),
            g[i].to_state(),
        ));
    }
}

/// Applies `rule` to parameter `p`, its state tensors and its gradient `g` in one pass, in place,
/// where that path exists (the CPU, contiguous tensors of one shape, the state in `p`'s state
/// dtype, `g` in `p`'s); returns false where the caller must use its composed fallback.
fn update_in_place<const N: usize>(
    p: &Tensor,
    state: [&Tensor; N],
    g: &Tensor,
    rule: &impl Rule<N>,
) -> Result<bool> {
    let like = |t: &Tensor, dtype: DType| {
        t.device().is_cpu() && t.is_contiguous() && t.dtype() == dtype && t.shape() == p.shape()
    };
    let lean = ops::fused::fused(p)
        && p.is_contiguous()
        && like(g, p.dtype())
        && state.iter().all(|s| like(s, state_dtype(p.dtype())));
    if !lean {
        return Ok(false);
    }
    let range = |t: &Tensor| t.layout().contiguous_offsets().expect("contiguous, checked above");
    let ranges: Vec<(usize, usize)> = std::iter::once(p).chain(state).map(range).collect();
    let (g_storage, g_layout) = g.storage_and_layout();
    let Storage::Cpu(g_storage) = &*g_storage else {
        candle_core::bail!("optimizer: gradient is not on the CPU")
    };
    fn typed<P: ParamElem, const N: usize>(
        held: Vec<&mut CpuStorage>,
        ranges: &[(usize, usize)],
        g: &CpuStorage,
        gl: &Layout,
        rule: &impl Rule<N>,
    ) -> Result<()> {
        let mut held = held.into_iter().zip(ranges).map(|(s, &(start, end))| (s, start, end));
        let (p, start, end) = held.next().expect("the parameter comes first");
        let p = &mut P::slice_mut(p).expect("dtype checked")[start..end];
        let state: Vec<&mut [P::State]> = held
            .map(|(s, start, end)| &mut P::State::slice_mut(s).expect("dtype checked")[start..end])
            .collect();
        let state: [&mut [P::State]; N] =
            state.try_into().unwrap_or_else(|_| unreachable!("one storage per state tensor"));
        run::<P, N>(&rule.at::<P::State>(), p, state, &slice::<P>(g, gl)?);
        Ok(())
    }
    let mut update = |held: Vec<&mut CpuStorage>| match p.dtype() {
        DType::F32 => typed::<f32, N>(held, &ranges, g_storage, g_layout, rule),
        DType::F64 => typed::<f64, N>(held, &ranges, g_storage, g_layout, rule),
        DType::BF16 => typed::<bf16, N>(held, &ranges, g_storage, g_layout, rule),
        DType::F16 => typed::<f16, N>(held, &ranges, g_storage, g_layout, rule),
        other => candle_core::bail!("optimizer: no in-place update of {other:?} parameters"),
    };
    with_storages_mut(&[&[p][..], &state[..]].concat(), Vec::new(), &mut update)?;
    Ok(true)
}

/// Multiplies every gradient of `vars` in `grads` by `factor`, in place where it can (an
/// accumulated sum of micro-batch gradients becomes their mean; an f16 loss scale is undone).
pub fn scale_grads(grads: &mut GradStore, vars: &[Var], factor: f64) -> Result<()> {
    for var in vars {
        let Some(g) = grads.get(var) else { continue };
        if ops::fused::fused(g) && g.is_contiguous() {
            g.inplace_op1(&Scale(factor))?;
        } else {
            let scaled = (g * factor)?;
            grads.insert(var.as_tensor(), scaled);
        }
    }
    Ok(())
}

/// `t *= factor` on a contiguous float CPU tensor, computed in f64.
struct Scale(f64);

impl InplaceOp1 for Scale {
    fn name(&self) -> &'static str {
        "scale"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        fn run<T: candle_core::WithDType>(d: &mut [T], factor: f64) {
            d.par_chunks_mut(CHUNK)
                .for_each(|d| d.iter_mut().for_each(|x| *x = T::from_f64(x.to_f64() * factor)));
        }
        let (start, end) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("scale: target is not contiguous".into()))?;
        match s {
            CpuStorage::F32(d) => run(&mut d[start..end], self.0),
            CpuStorage::F64(d) => run(&mut d[start..end], self.0),
            CpuStorage::BF16(d) => run(&mut d[start..end], self.0),
            CpuStorage::F16(d) => run(&mut d[start..end], self.0),
            s => candle_core::bail!("scale: float tensors only, not {:?}", s.dtype()),
        }
        Ok(())
    }
}

/// An optimizer a training run can stop and resume bit for bit: an update, and its whole state
/// as named tensors (moments, step count) to save and restore exactly.
pub trait TrainOptimizer {
    /// One update of every parameter `grads` holds a gradient for.
    fn update(&mut self, grads: &GradStore) -> Result<()> {
        self.begin_update()?;
        self.update_some(grads)
    }
    /// The update split over a step's backward (`--optimizer-in-backward`): `begin_update` once
    /// per step, before its parts, advances what the parameters share (the step count of the
    /// bias corrections; by default nothing); then [`TrainOptimizer::update_some`] for each part.
    fn begin_update(&mut self) -> Result<()> {
        Ok(())
    }
    /// Updates the parameters whose gradients `grads` holds, each as [`TrainOptimizer::update`]
    /// would: an update reads its own parameter's gradient and state alone, so parts that cover
    /// every parameter once give the bits of one update of them all.
    fn update_some(&mut self, _grads: &GradStore) -> Result<()> {
        candle_core::bail!("this optimizer does not update inside backward")
    }
    /// The state, by name ("step", "m.3", ...: per parameter, in the order of the vars given).
    fn state(&self) -> Result<HashMap<String, Tensor>>;
    /// Restores what [`TrainOptimizer::state`] returned; a missing or misshapen entry is an error.
    fn set_state(&mut self, state: &HashMap<String, Tensor>) -> Result<()>;
    /// Bytes of the state once every parameter has had a gradient (SGD's buffers start then).
    fn state_bytes(&self) -> u64;
    /// The whole state, to write in a training snapshot: [`TrainOptimizer::state`], except for
    /// an optimizer whose state is spread over processes (sharded over data-parallel ranks),
    /// which each must call this: the first gets the whole state, the others `None`.
    fn snapshot_state(&self) -> Result<Option<HashMap<String, Tensor>>> {
        Ok(Some(self.state()?))
    }
}

/// `state[name]`, shaped like `like`, as a tensor of `like`'s state dtype ([`state_dtype`]: a
/// bf16 parameter's SGD velocity stays f32, as it was trained and saved) on its device.
pub(crate) fn restored(
    state: &HashMap<String, Tensor>,
    name: &str,
    like: &Tensor,
) -> Result<Tensor> {
    let t = state
        .get(name)
        .ok_or_else(|| candle_core::Error::Msg(format!("optimizer state `{name}` is missing")))?;
    if t.dims() != like.dims() {
        candle_core::bail!(
            "optimizer state `{name}` is {:?}, the parameter {:?}",
            t.dims(),
            like.dims()
        )
    }
    t.to_dtype(state_dtype(like.dtype()))?.to_device(like.device())?.contiguous()?.copy()
}

pub(crate) fn step_count(state: &HashMap<String, Tensor>) -> Result<i64> {
    state
        .get("step")
        .ok_or_else(|| candle_core::Error::Msg("optimizer state `step` is missing".into()))?
        .to_scalar::<i64>()
}

/// AdamW as PyTorch's (single-tensor) implementation defines it: decoupled weight decay
/// `p *= 1 - lr wd`, `m = b1 m + (1 - b1) g`, `v = b2 v + (1 - b2) g^2`,
/// `p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`. Takes candle-nn's
/// [`ParamsAdamW`] (same defaults as PyTorch except weight decay 0.01, as PyTorch's AdamW).
pub struct AdamW {
    vars: Vec<Moments>,
    params: ParamsAdamW,
    step: i32,
    composed: bool,
}

impl AdamW {
    /// Updates with candle ops on the CPU too: the path other devices take (parameter-sized
    /// temporaries), for testing it where no other device is.
    pub fn composed(self) -> Self {
        AdamW { composed: true, ..self }
    }
}

struct Moments {
    var: Var,
    m: Tensor,
    v: Tensor,
}

/// [`AdamW`]'s update of one element at step `step` (from 1).
struct AdamWRule {
    params: ParamsAdamW,
    step: i32,
}

impl AdamWRule {
    /// The step's bias corrections: `lr / (1 - b1^t)` and `sqrt(1 - b2^t)`.
    fn step_size_and_bias2_sqrt(&self) -> (f64, f64) {
        let ParamsAdamW { lr, beta1, beta2, .. } = self.params;
        (lr / (1.0 - beta1.powi(self.step)), (1.0 - beta2.powi(self.step)).sqrt())
    }
}

impl Rule<2> for AdamWRule {
    fn at<S: Float + Send + Sync>(&self) -> impl Fn(S, [&mut S; 2], S) -> S + Sync {
        let ParamsAdamW { lr, beta1, beta2, eps, weight_decay } = self.params;
        let s = |x: f64| S::from(x).expect("a float constant");
        let (step_size, bias2_sqrt) = self.step_size_and_bias2_sqrt();
        let (decay, step_size, bias2_sqrt, eps) =
            (s(1.0 - lr * weight_decay), s(step_size), s(bias2_sqrt), s(eps));
        let (beta1, one_minus_beta1, beta2, one_minus_beta2) =
            (s(beta1), s(1.0 - beta1), s(beta2), s(1.0 - beta2));
        move |p, [m, v], g| {
            *m = beta1 * *m + one_minus_beta1 * g;
            *v = beta2 * *v + one_minus_beta2 * g * g;
            p * decay - step_size * *m / (v.sqrt() / bias2_sqrt + eps)
        }
    }
}

candle_optimizer!(AdamW, ParamsAdamW, |vars, params| {
    let vars = vars
        .into_iter()
        .filter(|v| v.dtype().is_float())
        .map(|var| Ok(Moments { m: state_zeros(&var)?, v: state_zeros(&var)?, var }))
        .collect::<Result<_>>()?;
    Ok(AdamW { vars, params, step: 0, composed: false })
});

impl TrainOptimizer for AdamW {
    fn begin_update(&mut self) -> Result<()> {
        self.step += 1;
        Ok(())
    }

    fn update_some(&mut self, grads: &GradStore) -> Result<()> {
        let ParamsAdamW { lr, beta1, beta2, eps, weight_decay } = self.params;
        let rule = AdamWRule { params: self.params.clone(), step: self.step };
        let (step_size, bias2_sqrt) = rule.step_size_and_bias2_sqrt();
        for Moments { var, m, v } in &mut self.vars {
            let Some(g) = grads.get(var) else { continue };
            let p = var.as_tensor();
            let lean = !self.composed && update_in_place(p, [&*m, &*v], g, &rule)?;
            if !lean {
                // In the state dtype: a bf16 parameter is updated in f32 and rounded once. Each
                // moment replaces the old one as soon as it is made, and each temporary goes as
                // soon as it is used, so no more than three of the parameter's size are alive.
                let g = g.detach().to_dtype(m.dtype())?;
                *m = ((&*m * beta1)? + (&g * (1.0 - beta1))?)?;
                *v = ((&*v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
                drop(g);
                let denom = ((v.sqrt()? / bias2_sqrt)? + eps)?;
                let update = ((&*m / denom)? * step_size)?;
                let next_p =
                    ((p.detach().to_dtype(m.dtype())? * (1.0 - lr * weight_decay))? - update)?;
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
            .flat_map(|(i, s)| [(format!("m.{i}"), s.m.clone()), (format!("v.{i}"), s.v.clone())])
            .collect();
        out.insert("step".into(), Tensor::new(self.step as i64, &candle_core::Device::Cpu)?);
        Ok(out)
    }

    fn set_state(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        for (i, s) in self.vars.iter_mut().enumerate() {
            s.m = restored(state, &format!("m.{i}"), &s.m)?;
            s.v = restored(state, &format!("v.{i}"), &s.v)?;
        }
        self.step = step_count(state)? as i32;
        Ok(())
    }

    fn state_bytes(&self) -> u64 {
        self.vars.iter().map(|s| tensor_bytes(&s.m) + tensor_bytes(&s.v)).sum()
    }
}

/// SGD with momentum and weight decay, as PyTorch defines it (no dampening, no Nesterov):
/// `v = momentum * v + (g + wd * p)`, `p -= lr * v`, the buffer starting at the first gradient.
/// candle-nn's SGD has no momentum.
pub struct SgdMomentum {
    vars: Vec<(Var, Option<Tensor>)>,
    params: ParamsSgd,
    composed: bool,
}

impl SgdMomentum {
    /// As [`AdamW::composed`].
    pub fn composed(self) -> Self {
        SgdMomentum { composed: true, ..self }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct ParamsSgd {
    pub lr: f64,
    pub momentum: f64,
    pub weight_decay: f64,
}

impl Default for ParamsSgd {
    fn default() -> Self {
        ParamsSgd { lr: 0.1, momentum: 0.9, weight_decay: 1e-4 }
    }
}

/// [`SgdMomentum`]'s update of one element; `first`: the buffer starts at this gradient.
struct SgdRule {
    params: ParamsSgd,
    first: bool,
}

impl Rule<1> for SgdRule {
    fn at<S: Float + Send + Sync>(&self) -> impl Fn(S, [&mut S; 1], S) -> S + Sync {
        let ParamsSgd { lr, momentum, weight_decay } = self.params;
        let s = |x: f64| S::from(x).expect("a float constant");
        let (lr, momentum, weight_decay, first) = (s(lr), s(momentum), s(weight_decay), self.first);
        move |p, [v], g| {
            let d = g + weight_decay * p;
            *v = if first { d } else { momentum * *v + d };
            p - lr * *v
        }
    }
}

candle_optimizer!(SgdMomentum, ParamsSgd, |vars, params| {
    Ok(SgdMomentum { vars: vars.into_iter().map(|v| (v, None)).collect(), params, composed: false })
});

impl TrainOptimizer for SgdMomentum {
    fn update_some(&mut self, grads: &GradStore) -> Result<()> {
        let ParamsSgd { lr, momentum, weight_decay } = self.params;
        for (var, velocity) in self.vars.iter_mut() {
            let Some(g) = grads.get(var) else { continue };
            let p = var.as_tensor();
            // The first step starts the buffer at g + wd p: momentum times a zero buffer adds 0.
            let first = velocity.is_none();
            if first {
                *velocity = Some(state_zeros(var)?);
            }
            let v = velocity.clone().expect("set above");
            let lean = !self.composed
                && update_in_place(p, [&v], g, &SgdRule { params: self.params, first })?;
            if !lean {
                let (g, p) = (g.detach().to_dtype(v.dtype())?, p.detach().to_dtype(v.dtype())?);
                let d = (g + (&p * weight_decay)?)?;
                let next_v = if first { d } else { ((&v * momentum)? + d)? };
                var.set(&(p - (&next_v * lr)?)?.to_dtype(var.dtype())?)?;
                *velocity = Some(next_v);
            }
        }
        Ok(())
    }

    /// A parameter's momentum buffer exists once it has had a gradient (PyTorch's rule), so the
    /// state holds only those.
    fn state(&self) -> Result<HashMap<String, Tensor>> {
        Ok(self
            .vars
            .iter()
            .enumerate()
            .filter_map(|(i, (_, v))| Some((format!("velocity.{i}"), v.clone()?)))
            .collect())
    }

    fn set_state(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        for (i, (var, velocity)) in self.vars.iter_mut().enumerate() {
            let name = format!("velocity.{i}");
            *velocity = if state.contains_key(&name) {
                Some(restored(state, &name, var.as_tensor())?)
            } else {
                None
            };
        }
        Ok(())
    }

    fn state_bytes(&self) -> u64 {
        self.vars
            .iter()
            .map(|(var, _)| (var.elem_count() * state_dtype(var.dtype()).size_in_bytes()) as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use candle_nn::Optimizer;

    const C: [f64; 3] = [0.5, -1.5, 3.0];

    /// Three steps of `opt` on loss = sum(w^2 / 2 + c w) (so g = w + c) against `by_hand(step, w,
    /// g)` updating f64 copies with the rule as PyTorch writes it.
    fn follows<O: Optimizer>(
        dtype: DType,
        tol: f64,
        build: impl Fn(Vec<Var>) -> Result<O>,
        mut by_hand: impl FnMut(i32, &mut [f64], &[f64]),
    ) -> Result<()> {
        let w =
            Var::from_tensor(&Tensor::new(&[1.0f32, -2.0, 0.25], &Device::Cpu)?.to_dtype(dtype)?)?;
        let c = Tensor::new(&C, &Device::Cpu)?.to_dtype(dtype)?;
        let mut opt = build(vec![w.clone()])?;
        let mut expect = [1.0f64, -2.0, 0.25];
        for step in 1..=3 {
            let loss = ((w.as_tensor().sqr()? * 0.5)? + w.as_tensor().mul(&c)?)?.sum_all()?;
            opt.step(&loss.backward()?)?;
            let g: Vec<f64> = expect.iter().zip(C).map(|(w, c)| w + c).collect();
            by_hand(step, &mut expect, &g);
            let got = w.as_tensor().to_dtype(DType::F64)?.to_vec1::<f64>()?;
            for (got, want) in got.iter().zip(expect) {
                assert!(
                    (got - want).abs() <= tol * (1.0 + want.abs()),
                    "{dtype:?} step {step}: {got} vs {want}"
                );
            }
        }
        Ok(())
    }

    fn adamw_by_hand(p: ParamsAdamW) -> impl FnMut(i32, &mut [f64], &[f64]) {
        let (mut m, mut v) = ([0.0; 3], [0.0; 3]);
        move |t, w, g| {
            for i in 0..3 {
                w[i] *= 1.0 - p.lr * p.weight_decay;
                m[i] = p.beta1 * m[i] + (1.0 - p.beta1) * g[i];
                v[i] = p.beta2 * v[i] + (1.0 - p.beta2) * g[i] * g[i];
                let denom = v[i].sqrt() / (1.0 - p.beta2.powi(t)).sqrt() + p.eps;
                w[i] -= p.lr / (1.0 - p.beta1.powi(t)) * m[i] / denom;
            }
        }
    }

    fn sgd_by_hand(p: ParamsSgd) -> impl FnMut(i32, &mut [f64], &[f64]) {
        let mut v = [0.0; 3];
        move |t, w, g| {
            for i in 0..3 {
                let d = g[i] + p.weight_decay * w[i];
                v[i] = if t == 1 { d } else { p.momentum * v[i] + d };
                w[i] -= p.lr * v[i];
            }
        }
    }

    /// Tolerances: the dtype's rounding of the parameter (half precision keeps f32 moments).
    const DTYPES: [(DType, f64); 4] =
        [(DType::F32, 1e-6), (DType::F64, 1e-12), (DType::BF16, 8e-3), (DType::F16, 1e-3)];

    #[test]
    fn adamw_follows_the_pytorch_update_rule() -> Result<()> {
        let p = ParamsAdamW { lr: 0.1, weight_decay: 0.1, ..Default::default() };
        for (dtype, tol) in DTYPES {
            follows(dtype, tol, |vars| AdamW::new(vars, p.clone()), adamw_by_hand(p.clone()))?;
            follows(
                dtype,
                tol,
                |vars| Ok(AdamW::new(vars, p.clone())?.composed()),
                adamw_by_hand(p.clone()),
            )?;
        }
        Ok(())
    }

    #[test]
    fn sgd_follows_the_pytorch_update_rule() -> Result<()> {
        let p = ParamsSgd { lr: 0.1, momentum: 0.9, weight_decay: 0.01 };
        for (dtype, tol) in DTYPES {
            follows(dtype, tol, |vars| SgdMomentum::new(vars, p), sgd_by_hand(p))?;
            follows(dtype, tol, |vars| Ok(SgdMomentum::new(vars, p)?.composed()), sgd_by_hand(p))?;
        }
        Ok(())
    }

    /// Updating in parts (the optimizer inside backward) gives the bits of one update, for every
    /// optimizer: three parameters over three steps, updated as {2} then {0, 1}, against all at
    /// once.
    #[test]
    fn an_update_in_parts_equals_one_update() -> Result<()> {
        type Build = fn(Vec<Var>) -> Result<Box<dyn TrainOptimizer>>;
        let optimizers: [(&str, Build); 3] = [
            ("adamw", |vars| {
                Ok(Box::new(AdamW::new(vars, ParamsAdamW { lr: 0.1, ..Default::default() })?))
            }),
            ("sgd", |vars| {
                Ok(Box::new(SgdMomentum::new(vars, ParamsSgd { lr: 0.1, ..Default::default() })?))
            }),
            ("adafactor", |vars| {
                Ok(Box::new(Adafactor::new(
                    vars,
                    ParamsAdafactor { lr: 0.1, ..Default::default() },
                )?))
            }),
        ];
        for (kind, build) in optimizers {
            let run = |parts: bool| -> Result<Vec<Vec<u32>>> {
                let vars = (0..3)
                    .map(|i| {
                        Var::from_tensor(
                            &Tensor::arange(i as f32, i as f32 + 6.0, &Device::Cpu)?
                                .reshape((2, 3))?,
                        )
                    })
                    .collect::<Result<Vec<Var>>>()?;
                let mut opt = build(vars.clone())?;
                for _ in 0..3 {
                    let loss =
                        vars.iter().try_fold(Tensor::new(0f32, &Device::Cpu)?, |acc, v| {
                            acc + v.as_tensor().powf(3.0)?.sum_all()?
                        })?;
                    let grads = loss.backward()?;
                    if !parts {
                        opt.update(&grads)?;
                        continue;
                    }
                    opt.begin_update()?;
                    for part in [&vars[2..], &vars[..2]] {
                        let mut some = GradStore::default();
                        for v in part {
                            some.insert(
                                v.as_tensor(),
                                grads.get(v).expect("every parameter has a gradient").clone(),
                            );
                        }
                        opt.update_some(&some)?;
                    }
                }
                vars.iter()
                    .map(|v| {
                        Ok(v.as_tensor()
                            .flatten_all()?
                            .to_vec1::<f32>()?
                            .iter()
                            .map(|x| x.to_bits())
                            .collect())
                    })
                    .collect()
            };
            let (whole, parts) = (run(false)?, run(true)?);
            assert!(
                whole != vec![vec![0u32; 6]; 3] && parts == whole,
                "{kind}: the update in parts differs from one update"
            );
        }
        Ok(())
    }

    /// A half-precision parameter keeps f32 moments, updated in place from its gradient.
    #[test]
    fn half_precision_parameters_keep_f32_state() -> Result<()> {
        let w = Var::from_tensor(&Tensor::ones(4, DType::BF16, &Device::Cpu)?)?;
        let mut opt = AdamW::new(vec![w.clone()], ParamsAdamW::default())?;
        opt.step(&w.as_tensor().sum_all()?.backward()?)?;
        let state = opt.state()?;
        assert_eq!(
            (state["m.0"].dtype(), state["v.0"].dtype(), w.dtype()),
            (DType::F32, DType::F32, DType::BF16)
        );
        assert_eq!(state["m.0"].to_vec1::<f32>()?, vec![0.1f32; 4]);
        assert_eq!(opt.state_bytes(), 2 * 4 * 4);
        Ok(())
    }

    /// SGD's buffers exist from the first gradient on; its state size counts them from the start.
    #[test]
    fn state_bytes_count_the_state_a_step_will_hold() -> Result<()> {
        let w = Var::from_tensor(&Tensor::ones(10, DType::F32, &Device::Cpu)?)?;
        let sgd = SgdMomentum::new(vec![w.clone()], ParamsSgd::default())?;
        assert!(sgd.state()?.is_empty());
        assert_eq!(sgd.state_bytes(), 40);
        assert_eq!(AdamW::new(vec![w], ParamsAdamW::default())?.state_bytes(), 80);
        Ok(())
    }
}
