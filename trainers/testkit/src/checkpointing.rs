//! The checkpointing checks every model's tests run, written once: two optimizer steps under a
//! policy, traced bit for bit (the loss, every parameter's gradient, the buffers after), equal to
//! `off`'s under every policy, every parameter with a non-zero gradient, and a negative control
//! that shows the comparison can fail.
//!
//! Not here: what a model's own tests add (its stored boundaries, its snapshots).

use candle_core::{DType, Tensor};
use remat::{Executor, Policy};
use std::collections::BTreeMap;
use trainable::{Model, OptimizerKind};

/// Bits by parameter or buffer name.
pub type Bits = BTreeMap<String, Vec<u32>>;

/// What a run switches off to show that a check can fail (a negative control).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    /// Nothing: the run as a user gets it.
    None,
    /// The executor's RNG replay: a recompute draws new dropout masks.
    NoRngReplay,
    /// The recompute flag the stages see: BatchNorm updates its statistics on recompute too.
    NoRecomputeFlag,
}

/// Two optimizer steps, bit for bit.
#[derive(Debug, PartialEq, Eq)]
pub struct Trace {
    /// Per step: the loss's bits and every gradient's, by parameter name.
    pub steps: Vec<(u32, Bits)>,
    /// The buffers (BatchNorm's running statistics) after the last step.
    pub buffers: Bits,
}

/// How a model's checkpointing test trains: a fresh model, the inputs of each step, the optimizer
/// and the executor's seed.
pub struct Training<'a, M> {
    pub build: &'a dyn Fn() -> M,
    /// The graph inputs of step `step`.
    pub inputs: &'a dyn Fn(&M, u64) -> Vec<Tensor>,
    pub optimizer: OptimizerKind,
    pub lr: f64,
    pub seed: u64,
}

impl<M: Model> Training<'_, M> {
    /// Two steps of a fresh model under `policy`, with `control` switched off.
    pub fn trace(&self, policy: &str, control: Control) -> Trace {
        let model = (self.build)();
        let policy: Policy = policy.parse().unwrap();
        let vars = model.params().vars();
        let mut exec = Executor::new(model.graph(), &policy, vars.clone(), self.seed).unwrap();
        exec = match control {
            Control::None => exec,
            Control::NoRngReplay => exec.without_rng_replay(),
            Control::NoRecomputeFlag => exec.without_recompute_flag(),
        };
        let mut opt = self.optimizer.build(vars, self.lr).unwrap();
        let steps = (0..2u64)
            .map(|step| {
                let out = exec.step(&(self.inputs)(&model, step), step).unwrap();
                opt.update(&out.grads).unwrap();
                let loss = out.loss.to_dtype(DType::F32).unwrap().to_scalar::<f32>().unwrap();
                (loss.to_bits(), model.params().grad_bits(&out.grads).unwrap())
            })
            .collect();
        Trace { steps, buffers: model.params().buffer_bits().unwrap() }
    }

    /// Under each of `policies` the losses, every gradient and the buffers equal `off`'s bit for
    /// bit (`what` says which configuration, in the failure).
    pub fn assert_policies_equal_off(&self, policies: &[&str], what: &str) {
        let off = self.trace("off", Control::None);
        for policy in policies {
            let run = self.trace(policy, Control::None);
            for (step, (a, b)) in off.steps.iter().zip(&run.steps).enumerate() {
                assert_eq!(a.0, b.0, "{what} {policy}: the loss differs from off at step {step}");
                let names = |bits: &Bits| bits.keys().cloned().collect::<Vec<_>>();
                assert_eq!(names(&a.1), names(&b.1), "{what} {policy}: parameters with a gradient");
                for (name, g) in &a.1 {
                    assert!(
                        g == &b.1[name],
                        "{what} {policy}: the gradient of {name} differs from off at step {step}"
                    );
                }
            }
            for (name, s) in &off.buffers {
                assert!(s == &run.buffers[name], "{what} {policy}: {name} differs from off");
            }
        }
    }

    /// Under each of `policies`, at every step, every parameter gets a gradient and none is all
    /// zero (several candle ops silently drop gradients).
    pub fn assert_every_parameter_learns(&self, policies: &[&str], what: &str) {
        let n = (self.build)().params().vars().len();
        for policy in policies {
            for (step, (_, grads)) in self.trace(policy, Control::None).steps.iter().enumerate() {
                assert_eq!(grads.len(), n, "{what} {policy}: parameters without a gradient");
                for (name, g) in grads {
                    assert!(
                        g.iter().any(|&b| f32::from_bits(b) != 0.0),
                        "{what} {policy}: the gradient of {name} is all zero at step {step}"
                    );
                }
            }
        }
    }

    /// With `control` switched off, `policy` no longer equals `off`: without RNG replay the first
    /// step's gradients differ, without the recompute flag the buffers do. The bit-for-bit
    /// checks can fail.
    pub fn assert_control_breaks(&self, policy: &str, control: Control) {
        let (off, run) = (self.trace("off", Control::None), self.trace(policy, control));
        let differs = match control {
            Control::None => panic!("a negative control switches something off"),
            Control::NoRngReplay => off.steps[0].1 != run.steps[0].1,
            Control::NoRecomputeFlag => off.buffers != run.buffers,
        };
        assert!(differs, "{policy} with {control:?} still equals off: the check cannot fail");
    }
}

/// The shapes a model's [`trainable::Benchable::parameter_shapes`] and
/// [`trainable::Benchable::adapter_shapes`] derive from `config` are those of the model built
/// (how the trainers refuse a size and the harness predicts a state before building): its own
/// parameters, trained or frozen, and its LoRA adapters.
pub fn assert_parameter_shapes_match_the_model<M: trainable::Benchable>(config: &M::Config) {
    let model = M::build(config, &candle_core::Device::Cpu, 0).unwrap();
    let is_adapter = params::lora::is_adapter;
    let built = |keep: &dyn Fn(&str) -> bool| trainable::shapes_where(model.params(), keep);
    let sorted = |mut shapes: Vec<Vec<usize>>| {
        shapes.sort();
        shapes
    };
    let (base, adapters) = (built(&|name| !is_adapter(name)), built(&is_adapter));
    assert_eq!(sorted(M::parameter_shapes(config).unwrap()), sorted(base), "{config:?}");
    assert_eq!(sorted(M::adapter_shapes(config).unwrap()), sorted(adapters), "{config:?}");
}
