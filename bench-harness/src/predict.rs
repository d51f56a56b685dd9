//! What a `gpt2-24gb` configuration should need before it runs, so that one that cannot fit is not
//! started and the table can say what it would have needed.
//!
//! - The model state is exact arithmetic on the parameter shapes: the parameters and their
//!   gradients in f32 whatever the activation dtype (they are the master weights), bf16 under
//!   `bf16-weights`; and the optimizer's state, f32 in every variant: AdamW two moments per
//!   parameter, Adafactor R + C numbers per R x C weight (a vector whole), SGD one buffer.
//! - The activations are scaled from gpt2-small's measured activation peak under the same state
//!   variant and policy (the calibration, run first). The head's part is taken out and computed
//!   for the model: the logits and their gradient (B T V values each, in the activation dtype),
//!   and the tied embedding's gradient in flight, V C values (in the weights' dtype) four times (candle's backward
//!   briefly holds three tensors of a gradient's size, and the executor keeps the head's share
//!   until the embedding's arrives). The rest (the blocks) is scaled by the width times the blocks
//!   a policy keeps: L for `off` and `every-two-blocks` (every block's output, or every other
//!   one, is stored), sqrt(L) for `sqrt`.

use crate::measure::Record;
use crate::workloads::Workload;
use anyhow::{Context, Result};
use layers::{OptimizerKind, Precision};
use remat::Policy;
use serde::{Deserialize, Serialize};

/// Predicted bytes of one configuration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
    /// `None` for the calibration configuration itself (gpt2-small).
    pub activations: Option<u64>,
}

impl Prediction {
    /// Everything at the step's peak: the state, the gradients and the activations.
    pub fn total(&self) -> Option<u64> {
        Some(self.params + self.grads + self.optimizer + self.activations?)
    }
}

/// The bytes of the parameters and of their gradients (in `precision`'s weight dtype) and of
/// `optimizer`'s state (f32).
pub fn state(shapes: &[Vec<usize>], optimizer: OptimizerKind, precision: Precision) -> (u64, u64, u64) {
    let count = |s: &Vec<usize>| s.iter().product::<usize>() as u64;
    let params: u64 = shapes.iter().map(count).sum();
    let state = match optimizer {
        OptimizerKind::Sgd => params,
        OptimizerKind::Adamw => 2 * params,
        OptimizerKind::Adafactor => shapes
            .iter()
            .map(|s| match s.as_slice() {
                [lead @ .., r, c] => lead.iter().product::<usize>() as u64 * (r + c) as u64,
                _ => count(s),
            })
            .sum(),
    };
    let weight = precision.weights().size_in_bytes() as u64;
    (weight * params, weight * params, 4 * state)
}

/// GPT-2's configuration from a `gpt2-24gb` model name, `gpt2-<size>/<variant>`.
pub fn gpt2_config(model: &str) -> Result<gpt2::Config> {
    let size = model.strip_prefix("gpt2-").and_then(|m| m.split('/').next()).with_context(|| format!("`{model}` is not a gpt2-24gb model"))?;
    Ok(size.parse::<gpt2::Preset>()?.config())
}

/// The blocks whose activations a policy keeps alive, as the scale of the block part.
fn kept_blocks(policy: &Policy, layers: usize) -> f64 {
    match policy {
        Policy::Sqrt => (layers as f64).sqrt(),
        _ => layers as f64,
    }
}

/// The head's part of the activation peak: the logits and their gradient, and the tied
/// embedding's gradient in flight.
fn head_bytes(w: &Workload, config: &gpt2::Config) -> u64 {
    let logits = 2 * w.batch * w.input_size * config.vocab_size * w.dtype.dtype().size_in_bytes();
    (logits + 4 * config.vocab_size * config.n_embd * w.dtype.weights().size_in_bytes()) as u64
}

/// The prediction for `w` under `policy`; `calibration` is gpt2-small's workload and measured
/// record under the same variant and policy (`None` for gpt2-small itself).
pub fn predict(w: &Workload, policy: &Policy, calibration: Option<(&Workload, &Record)>) -> Result<Prediction> {
    let (params, grads, optimizer) = state(&w.parameter_shapes()?, w.optimizer(), w.dtype);
    let activations = match calibration {
        Some((cw, rec)) => {
            let (me, small) = (gpt2_config(&w.model)?, gpt2_config(&cw.model)?);
            let blocks = rec.activation_peak_bytes.saturating_sub(head_bytes(cw, &small)) as f64;
            let scale = (me.n_embd as f64 * kept_blocks(policy, me.n_layer)) / (small.n_embd as f64 * kept_blocks(policy, small.n_layer));
            let tokens = (w.batch * w.input_size) as f64 / (cw.batch * cw.input_size) as f64;
            Some(head_bytes(w, &me) + (blocks * scale * tokens) as u64)
        }
        None => None,
    };
    Ok(Prediction { params, grads, optimizer, activations })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-2 XL's published parameter count and the bytes per parameter of each way of holding
    /// its state: f32 weights, gradients and AdamW moments 16; bf16 weights and gradients with f32
    /// moments 12; Adafactor's factored statistics a few MB beside f32 weights and gradients.
    #[test]
    fn the_state_of_gpt2_xl_by_arithmetic() {
        let shapes = <gpt2::Gpt2 as layers::Benchable>::parameter_shapes(&gpt2::Preset::Xl.config()).unwrap();
        let n: u64 = shapes.iter().map(|s| s.iter().product::<usize>() as u64).sum();
        assert_eq!(n, 1_557_611_200);
        let total = |(p, g, o): (u64, u64, u64)| p + g + o;
        assert_eq!(total(state(&shapes, OptimizerKind::Adamw, Precision::F32)), 16 * n);
        assert_eq!(total(state(&shapes, OptimizerKind::Adamw, Precision::Bf16)), 16 * n);
        assert_eq!(total(state(&shapes, OptimizerKind::Adamw, Precision::Bf16Weights)), 12 * n);
        let (p, g, o) = state(&shapes, OptimizerKind::Adafactor, Precision::Bf16);
        assert_eq!((p, g), (4 * n, 4 * n));
        assert!(o < 20 << 20, "Adafactor's state of GPT-2 XL: {o} bytes");
    }
}
