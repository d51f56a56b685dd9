//! The in-place update on the CPU: one pass over a parameter, its state and its gradient, each
//! element computed in the state dtype by an optimizer's [`Rule`] and split over threads; and
//! scaling gradients in place ([`scale_grads`]).
//!
//! Not here: the rules themselves (each optimizer's file), the composed fallback other devices
//! take (each optimizer's `update_some`).

use crate::state::state_dtype;
use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Result, Storage, Tensor, Var, WithDType};
use half::{bf16, f16};
use num_traits::Float;
use ops::fused::slice;
use rayon::prelude::*;
use std::cell::Cell;

/// Elements per task of an in-place update.
const CHUNK: usize = 1 << 15;

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
pub(crate) trait Rule<const N: usize>: Sync {
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
pub(crate) fn update_in_place<const N: usize>(
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
