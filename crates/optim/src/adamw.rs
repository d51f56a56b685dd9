//! AdamW, updated in place: the rule of one element, the optimizer over a model's parameters.
//!
//! Not here: the in-place pass the rule runs in (`in_place`), the state's dtype and step count
//! (`state`).

use crate::in_place::{update_in_place, Rule};
use crate::state::{restored, state_zeros, StepCount};
use crate::TrainOptimizer;
use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};
pub use candle_nn::ParamsAdamW;
use num_traits::Float;
use remat::memory::tensor_bytes;
use std::collections::HashMap;

/// AdamW as PyTorch's (single-tensor) implementation defines it: decoupled weight decay
/// `p *= 1 - lr wd`, `m = b1 m + (1 - b1) g`, `v = b2 v + (1 - b2) g^2`,
/// `p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`. Takes candle-nn's
/// [`ParamsAdamW`] (same defaults as PyTorch except weight decay 0.01, as PyTorch's AdamW).
pub struct AdamW {
    vars: Vec<Moments>,
    params: ParamsAdamW,
    step: StepCount,
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
    Ok(AdamW { vars, params, step: StepCount::default(), composed: false })
});

impl TrainOptimizer for AdamW {
    fn begin_update(&mut self) -> Result<()> {
        self.step.begin_update()
    }

    fn update_some(&mut self, grads: &GradStore) -> Result<()> {
        let ParamsAdamW { lr, beta1, beta2, eps, weight_decay } = self.params;
        let rule = AdamWRule { params: self.params.clone(), step: self.step.get() as i32 };
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
        self.step.save(&mut out)?;
        Ok(out)
    }

    fn set_state(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        for (i, s) in self.vars.iter_mut().enumerate() {
            s.m = restored(state, &format!("m.{i}"), &s.m)?;
            s.v = restored(state, &format!("v.{i}"), &s.v)?;
        }
        self.step = StepCount::restore(state)?;
        Ok(())
    }

    fn state_bytes(&self) -> u64 {
        self.vars.iter().map(|s| tensor_bytes(&s.m) + tensor_bytes(&s.v)).sum()
    }
}
