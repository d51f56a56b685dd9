use crate::params::{Init, ParamStore};
use candle_core::{Result, Tensor};

/// Layer normalisation over the last dimension, with `weight` and `bias` as Hugging Face names
/// them. Built from elementary ops (`layer_norm_slow`) because the fused kernel has no backward.
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f32,
}

impl LayerNorm {
    pub fn new(params: &mut ParamStore, prefix: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(LayerNorm {
            weight: params.get(&format!("{prefix}.weight"), &[dim], Init::Ones)?,
            bias: params.get(&format!("{prefix}.bias"), &[dim], Init::Zeros)?,
            eps: eps as f32,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        candle_nn::ops::layer_norm_slow(x, &self.weight, &self.bias, self.eps)
    }
}
