//! What every optimizer's state shares: the dtype it is kept in (f32 for a half-precision
//! parameter), zeros to start it, restoring it from a snapshot, and the step count that bias
//! corrections and step sizes read.
//!
//! Not here: how a state is updated (each optimizer's file, `in_place`), which names it is saved
//! under (each optimizer's [`crate::TrainOptimizer::state`]).

use candle_core::{DType, Result, Tensor, Var};
use std::collections::HashMap;

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

/// How many updates an optimizer has made (AdamW's bias corrections and Adafactor's step sizes
/// read it), saved in its state as `step`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct StepCount(i64);

impl StepCount {
    /// The count now: 0 before the first update, `t` during the t-th.
    pub(crate) fn get(self) -> i64 {
        self.0
    }

    /// [`crate::TrainOptimizer::begin_update`] of an optimizer that counts steps: once per step,
    /// before its parts, so that every part of a step reads the same count.
    pub(crate) fn begin_update(&mut self) -> Result<()> {
        self.0 += 1;
        Ok(())
    }

    /// Adds the count to `state` as `step`, a scalar i64 on the CPU.
    pub(crate) fn save(self, state: &mut HashMap<String, Tensor>) -> Result<()> {
        state.insert("step".into(), Tensor::new(self.0, &candle_core::Device::Cpu)?);
        Ok(())
    }

    /// The count [`StepCount::save`] put in `state`; an error where it is missing.
    pub(crate) fn restore(state: &HashMap<String, Tensor>) -> Result<Self> {
        let step = state
            .get("step")
            .ok_or_else(|| candle_core::Error::Msg("optimizer state `step` is missing".into()))?
            .to_scalar::<i64>()?;
        Ok(StepCount(step))
    }
}
