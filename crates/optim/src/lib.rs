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
//! Not here: which optimizer a run picks by name (the `trainable` crate's `OptimizerKind`), the
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
mod adamw;
mod in_place;
mod sgd;
mod state;
#[cfg(test)]
mod tests;

pub use adafactor::{Adafactor, ParamsAdafactor};
pub use adamw::{AdamW, ParamsAdamW};
pub use in_place::scale_grads;
pub use sgd::{ParamsSgd, SgdMomentum};

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor};
use std::collections::HashMap;

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
