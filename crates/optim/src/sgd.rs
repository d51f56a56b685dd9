//! SGD with momentum and weight decay, updated in place: the rule of one element, the optimizer
//! over a model's parameters.
//!
//! Not here: the in-place pass the rule runs in (`in_place`), the state's dtype (`state`).

use crate::in_place::{update_in_place, Rule};
use crate::state::{restored, state_dtype, state_zeros};
use crate::TrainOptimizer;
use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};
use num_traits::Float;
use std::collections::HashMap;

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
