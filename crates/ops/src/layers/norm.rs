//! The normalisation layers without batch state: LayerNorm and RMSNorm over the last dimension
//! (the fused kernels) and GroupNorm over groups of channels (composed). Not here: BatchNorm
//! (`layers::batch_norm`), the kernels (`fused::layer_norm`, `fused::rms_norm`).

use candle_core::{Result, Tensor};
use params::{Init, ParamStore};

/// Layer normalisation over the last dimension, with `weight` and `bias` as Hugging Face names
/// them: [`crate::fused::layer_norm`] (candle-nn's fused kernel has no backward).
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    pub fn new(params: &mut ParamStore, prefix: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(LayerNorm {
            weight: params.get(&format!("{prefix}.weight"), &[dim], Init::Ones)?,
            bias: params.get(&format!("{prefix}.bias"), &[dim], Init::Zeros)?,
            eps,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        crate::fused::layer_norm(x, &self.weight, &self.bias, self.eps)
    }
}

/// Root-mean-square normalisation over the last dimension (Zhang & Sennrich, 2019), as Llama's
/// `LlamaRMSNorm`, scaled by `weight` (no centring, no bias): [`crate::fused::rms_norm`], which
/// keeps only its input for backward.
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn new(params: &mut ParamStore, prefix: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(RmsNorm { weight: params.get(&format!("{prefix}.weight"), &[dim], Init::Ones)?, eps })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        crate::fused::rms_norm(x, &self.weight, self.eps)
    }
}

/// Group normalisation over (N, C, *spatial) input (Wu & He, 2018): statistics per sample and
/// group of channels, so it behaves the same at any batch size and has no running state.
pub struct GroupNorm {
    weight: Tensor,
    bias: Tensor,
    groups: usize,
    eps: f64,
}

impl GroupNorm {
    pub fn new(
        params: &mut ParamStore,
        prefix: &str,
        channels: usize,
        groups: usize,
    ) -> Result<Self> {
        if groups == 0 || !channels.is_multiple_of(groups) {
            candle_core::bail!(
                "GroupNorm `{prefix}`: {channels} channels do not split into {groups} groups"
            )
        }
        Ok(GroupNorm {
            weight: params.get(&format!("{prefix}.weight"), &[channels], Init::Ones)?,
            bias: params.get(&format!("{prefix}.bias"), &[channels], Init::Zeros)?,
            groups,
            eps: 1e-5,
        })
    }

    /// Composed from candle ops, in f32 for a half-precision x (candle's CPU ops would reduce it
    /// in its own precision), which then keeps f32 copies for backward.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (n, c) = (x.dim(0)?, x.dim(1)?);
        let dtype = x.dtype();
        let x = &crate::fused::widened(x)?;
        let grouped = x.reshape((n, self.groups, ()))?; // (N, G, C/G * spatial)
        let centered = grouped.broadcast_sub(&grouped.mean_keepdim(2)?)?;
        let var = centered.sqr()?.mean_keepdim(2)?;
        let normed = centered.broadcast_div(&(var + self.eps)?.sqrt()?)?.reshape(x.shape())?;
        let mut shape = vec![1; x.rank()];
        shape[1] = c;
        let (weight, bias) =
            (crate::fused::widened(&self.weight)?, crate::fused::widened(&self.bias)?);
        normed
            .broadcast_mul(&weight.reshape(shape.as_slice())?)?
            .broadcast_add(&bias.reshape(shape.as_slice())?)?
            .to_dtype(dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn group_norm_normalises_each_group_of_each_sample() -> Result<()> {
        let mut params = ParamStore::new(&Device::Cpu, DType::F32, 0);
        let gn = GroupNorm::new(&mut params, "gn", 4, 2)?;
        let x: Vec<f32> = remat::rng::RngKey::named(0, "x").normal(2 * 4 * 3 * 3, 3.0, 2.0);
        let y = gn.forward(&Tensor::from_vec(x, (2, 4, 3, 3), &Device::Cpu)?)?;
        let groups = y.reshape((2, 2, 18))?;
        let mean = groups.mean_keepdim(2)?.flatten_all()?.to_vec1::<f32>()?;
        let var = groups.sqr()?.mean_keepdim(2)?.flatten_all()?.to_vec1::<f32>()?;
        assert!(
            mean.iter().all(|m| m.abs() < 1e-5) && var.iter().all(|v| (v - 1.0).abs() < 1e-3),
            "{mean:?} {var:?}"
        );
        assert!(GroupNorm::new(&mut params, "bad", 6, 4).is_err());
        Ok(())
    }
}
