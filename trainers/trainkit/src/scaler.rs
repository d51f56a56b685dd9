//! f16's dynamic loss scaling, and the gradients of an accumulated step made ready for the update.

use anyhow::Result;
use candle_core::backprop::GradStore;
use candle_core::DType;

/// Dynamic loss scaling for f16, as PyTorch's `GradScaler`: backward starts from the loss times
/// `scale`; a step with non-finite gradients is skipped and the scale halved; after
/// `GROWTH_INTERVAL` good steps in a row it doubles.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaler {
    pub scale: f64,
    /// Good steps since the scale last changed.
    pub good_steps: u64,
}

impl LossScaler {
    pub const GROWTH_INTERVAL: u64 = 2000;

    /// After a step whose gradients were (`finite`) or were not all finite.
    fn after(&mut self, finite: bool) {
        if !finite {
            *self = LossScaler { scale: self.scale / 2.0, good_steps: 0 };
        } else if self.good_steps + 1 == Self::GROWTH_INTERVAL {
            *self = LossScaler { scale: self.scale * 2.0, good_steps: 0 };
        } else {
            self.good_steps += 1;
        }
    }
}

/// The gradients of an optimizer step's `micro_batches` micro-batches, accumulated under the loss
/// scale of `scaler` (f16), made ready for the update: the scaler told whether they are finite,
/// and, if they are, divided by the micro-batch count and the loss scale in place. Returns whether
/// the update goes ahead (false: a non-finite gradient, the step is skipped).
pub fn finish_gradients(
    grads: &mut GradStore,
    vars: &[candle_core::Var],
    micro_batches: usize,
    scaler: Option<&mut LossScaler>,
) -> Result<bool> {
    let scale = scaler.as_ref().map_or(1.0, |s| s.scale);
    if let Some(scaler) = scaler {
        let finite = all_finite(grads, vars)?;
        scaler.after(finite);
        if !finite {
            return Ok(false);
        }
    }
    let factor = 1.0 / (micro_batches as f64 * scale);
    if factor != 1.0 {
        optim::scale_grads(grads, vars, factor)?;
    }
    Ok(true)
}

/// PyTorch's initial scale, 2^16.
impl Default for LossScaler {
    fn default() -> Self {
        LossScaler { scale: 65536.0, good_steps: 0 }
    }
}

/// Whether every gradient of `vars` in `grads` is finite (a sum per gradient: an infinity or a
/// NaN anywhere makes it non-finite). The gradients side by side on the threads: a sum runs on
/// one, and one after the other they were 2% of a ResNet-152 step with the other core idle.
pub(crate) fn all_finite(grads: &GradStore, vars: &[candle_core::Var]) -> Result<bool> {
    use rayon::prelude::*;
    let finite = |g: &candle_core::Tensor| -> Result<bool> {
        Ok(g.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?.is_finite())
    };
    // Any gradient that is not finite, or whose check failed, settles it.
    vars.par_iter()
        .filter_map(|v| grads.get(v))
        .map(finite)
        .find_any(|r| !matches!(r, Ok(true)))
        .unwrap_or(Ok(true))
}

#[cfg(test)]
mod tests {
    use super::LossScaler;

    /// f16's scale doubles after `GROWTH_INTERVAL` good steps in a row, and an overflow halves it
    /// and restarts the count (PyTorch's `GradScaler`). The test runs long enough to reach the
    /// growth.
    #[test]
    fn the_loss_scale_grows_after_its_interval_and_halves_on_overflow() {
        let mut s = LossScaler::default();
        for _ in 0..LossScaler::GROWTH_INTERVAL - 1 {
            s.after(true);
        }
        assert_eq!(s, LossScaler { scale: 65536.0, good_steps: LossScaler::GROWTH_INTERVAL - 1 });
        s.after(true);
        assert_eq!(s, LossScaler { scale: 131072.0, good_steps: 0 });
        s.after(true);
        s.after(false);
        assert_eq!(s, LossScaler { scale: 65536.0, good_steps: 0 });
    }
}
