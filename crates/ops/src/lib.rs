//! `ops`: the layers candle lacks or gets wrong, for training under checkpointing.
//!
//! Two levels: the layers a model calls (the `layers` module, re-exported here, and
//! [`dropout`] and [`attention`] at this root), and the kernels behind them ([`fused`]).
//!
//! - [`fused`]: LayerNorm, RMSNorm, softmax, cross-entropy, BatchNorm + ReLU, dropout, linear,
//!   GELU, the SiLU-gated product, attention (with a rotary embedding inside where asked) and
//!   conv3d as single ops with hand-written backward passes that keep only what
//!   backward needs (candle's own fused LayerNorm and softmax record no backward; composed ones
//!   keep every intermediate). [`attention`] is the attention with a keyed dropout, its causal
//!   mask a [`Mask`]; [`rotary_attention`] turns q and k by position inside it.
//! - [`dropout`] draws its mask from the stage's counter-based key, so a recompute under
//!   checkpointing reproduces it exactly (candle's `ops::dropout` uses unseedable global RNG), and
//!   draws it again in backward instead of holding it.
//! - [`LayerNorm`] runs the fused kernel (its parameters get gradients, unlike candle-nn's).
//! - [`BatchNorm`] does not update its running statistics while a stage is recomputed.
//! - [`max_pool2d_k3s2p1`]: the ResNet stem pool with a correct backward (candle's is only right
//!   when kernel == stride).
//! - [`conv3d`], [`conv_transpose3d_k2s2`], [`max_pool3d_k2s2`]: 3D layers candle lacks, composed
//!   from 2D convolutions, matmuls and reshapes that have a backward; [`conv3d_concat`] convolves
//!   two tensors' channels side by side without concatenating them; [`conv2d`] runs the fused
//!   convolution kernel where it can (a lean backward), candle's elsewhere.
//! - [`record_convolutions`] lists the convolutions a forward pass runs, for the kernel bench.
//! - [`Linear`]: a linear layer in either published weight layout ([`WeightLayout`], from
//!   `params`), with its LoRA adapter (`params::lora`) beside it as one op where the
//!   configuration targets it.
//!
//! Not here: the parameters these layers read (the `params` crate), the optimizers (`optim`),
//! the models (the trainer crates), the checkpointing engine (`remat`).

pub mod fused;
mod layers;
mod recorded;

pub use fused::{allocate_matmul_workspaces, matmul_peak_gflops, Conv3dGeometry, Mask};
pub use layers::{
    conv2d, conv3d, conv3d_concat, conv_transpose3d_k2s2, max_pool2d_k3s2p1, max_pool3d_k2s2,
    BatchNorm, GroupNorm, LayerNorm, Linear, RmsNorm,
};
pub use params::WeightLayout;
pub use recorded::{record_convolutions, ConvCall, ConvKind};

use candle_core::{Result, Tensor};
use remat::StageCtx;

/// Inverted dropout with a mask keyed by the stage context: identical on recompute, different for
/// every call site, stage and step. Identity outside training or for `p == 0`.
pub fn dropout(x: &Tensor, p: f32, ctx: &StageCtx) -> Result<Tensor> {
    match dropout_key(p, ctx)? {
        Some(key) => fused::dropout(x, key, p),
        None => Ok(x.clone()),
    }
}

/// The key of a dropout with probability `p`, or `None` where it is the identity (evaluation,
/// `p == 0`); an error for `p` outside [0, 1) ([`StageCtx::dropout_key`]).
pub(crate) fn dropout_key(p: f32, ctx: &StageCtx) -> Result<Option<remat::rng::RngKey>> {
    ctx.dropout_key(p)
}

/// Scaled dot-product attention of q, k, v (B, heads, T, d) with dropout `p` on the attention
/// probabilities, its mask keyed like [`dropout`]'s, the causal mask where `mask` is
/// [`Mask::Causal`], and an optional key padding mask (B, T) ([`fused::attention`]).
pub fn attention(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    scale: f64,
    mask: Mask,
    padding: Option<&Tensor>,
    p: f32,
    ctx: &StageCtx,
) -> Result<Tensor> {
    fused::attention(q, k, v, scale, mask, padding, dropout_key(p, ctx)?.map(|key| (key, p)))
}

/// [`attention`] with q and k turned by the rotary embedding `rotary` inside the op
/// ([`fused::rotary_attention`]), without key padding; q, k, v and the output token by token
/// (B, T, heads, d).
pub fn rotary_attention(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    rotary: &fused::Rotary,
    scale: f64,
    mask: Mask,
    p: f32,
    ctx: &StageCtx,
) -> Result<Tensor> {
    let dropout = dropout_key(p, ctx)?.map(|key| (key, p));
    fused::rotary_attention(q, k, v, rotary, scale, mask, dropout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn dropout_masks_replay_on_recompute_and_differ_elsewhere() -> Result<()> {
        let x = Tensor::ones((64, 64), candle_core::DType::F32, &Device::Cpu)?;
        let run = |step, stage, recompute| {
            let ctx = StageCtx::new(remat::RunPoint {
                seed: 1,
                step,
                stage,
                recompute,
                train: true,
                ..Default::default()
            });
            let a = dropout(&x, 0.25, &ctx)?.flatten_all()?.to_vec1::<f32>()?;
            let b = dropout(&x, 0.25, &ctx)?.flatten_all()?.to_vec1::<f32>()?;
            Ok::<_, candle_core::Error>((a, b))
        };
        let (a, b) = run(3, 2, false)?;
        assert_eq!(run(3, 2, true)?, (a.clone(), b.clone()), "recompute must replay both masks");
        assert_ne!(a, b, "two call sites must draw different masks");
        assert_ne!(run(4, 2, false)?.0, a, "another step must draw another mask");
        assert_ne!(run(3, 1, false)?.0, a, "another stage must draw another mask");
        let kept = a.iter().filter(|&&v| v != 0.0).count() as f32 / a.len() as f32;
        assert!((kept - 0.75).abs() < 0.03, "kept {kept}");
        assert!(a.iter().all(|&v| v == 0.0 || v == 1.0 / 0.75));
        let eval = dropout(&x, 0.25, &StageCtx::eval())?;
        assert_eq!(eval.sum_all()?.to_scalar::<f32>()?, 4096.0);
        Ok(())
    }
}
