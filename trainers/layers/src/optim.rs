use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};
use candle_nn::Optimizer;

/// SGD with momentum and weight decay, as PyTorch defines it (no dampening, no Nesterov):
/// `v = momentum * v + (g + wd * p)`, `p -= lr * v`. candle-nn's SGD has no momentum.
pub struct SgdMomentum {
    vars: Vec<(Var, Option<Tensor>)>,
    params: ParamsSgd,
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

impl Optimizer for SgdMomentum {
    type Config = ParamsSgd;

    fn new(vars: Vec<Var>, params: ParamsSgd) -> Result<Self> {
        Ok(SgdMomentum { vars: vars.into_iter().map(|v| (v, None)).collect(), params })
    }

    fn step(&mut self, grads: &GradStore) -> Result<()> {
        let p = self.params;
        for (var, velocity) in self.vars.iter_mut() {
            let Some(g) = grads.get(var) else { continue };
            // Detached: arithmetic on a Var records a graph, and a velocity built on last step's
            // would keep every earlier step's gradients alive.
            let w = var.as_tensor().detach();
            let g = if p.weight_decay != 0.0 { (g.detach() + (&w * p.weight_decay)?)? } else { g.detach() };
            let v = match velocity.take() {
                Some(v) => ((v * p.momentum)? + g)?,
                None => g, // PyTorch starts the buffer at the first gradient
            };
            var.set(&(w - (&v * p.lr)?)?)?;
            *velocity = Some(v.detach());
        }
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn follows_the_pytorch_update_rule() -> Result<()> {
        let w = Var::new(&[1.0f32, -2.0], &Device::Cpu)?;
        let mut opt = SgdMomentum::new(vec![w.clone()], ParamsSgd { lr: 0.1, momentum: 0.9, weight_decay: 0.0 })?;
        // loss = sum(w^2): g = 2w.
        let mut expect = [1.0f64, -2.0];
        let mut v = [0.0f64; 2];
        for step in 0..3 {
            let grads = w.as_tensor().sqr()?.sum_all()?.backward()?;
            opt.step(&grads)?;
            for i in 0..2 {
                let g = 2.0 * expect[i];
                v[i] = if step == 0 { g } else { 0.9 * v[i] + g };
                expect[i] -= 0.1 * v[i];
            }
            let got = w.as_tensor().to_vec1::<f32>()?;
            for i in 0..2 {
                assert!((got[i] as f64 - expect[i]).abs() < 1e-6, "step {step}: {got:?} vs {expect:?}");
            }
        }
        Ok(())
    }
}
