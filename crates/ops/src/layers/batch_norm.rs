//! The BatchNorm layer a model calls: its parameters and running statistics, the batch's
//! statistics in training (not updating the running ones while a stage is recomputed), the
//! running ones in evaluation; fused with the residual and ReLU that follow it where the kernel
//! runs, or with the ReLU and the convolution that reads its output. Not here: the kernels and
//! the device-generic route (`fused::batch_norm`, `fused::conv3d`).

use crate::fused::{Activation, Conv3dGeometry};
use crate::recorded::{recorded, ConvKind};
use candle_core::{DType, Result, Tensor, Var};
use params::{Init, ParamStore};
use remat::StageCtx;

/// Batch normalisation over (N, C, *spatial) input of any rank (2D and 3D convolutions alike),
/// with torchvision's names (`weight`, `bias`, `running_mean`, `running_var`).
///
/// In training it normalises with the batch statistics and updates the running statistics, except
/// while the executor recomputes the stage: a checkpointed model must update them once per step,
/// as an unchecked one does (PyTorch's checkpoint updates them twice: pytorch/pytorch#96136).
pub struct BatchNorm {
    weight: Tensor,
    bias: Tensor,
    running_mean: Var,
    running_var: Var,
    eps: f64,
    momentum: f64,
}

impl BatchNorm {
    pub fn new(params: &mut ParamStore, prefix: &str, channels: usize) -> Result<Self> {
        Ok(BatchNorm {
            weight: params.get(&format!("{prefix}.weight"), &[channels], Init::Ones)?,
            bias: params.get(&format!("{prefix}.bias"), &[channels], Init::Zeros)?,
            running_mean: params.buffer(
                &format!("{prefix}.running_mean"),
                &[channels],
                Init::Zeros,
            )?,
            running_var: params.buffer(
                &format!("{prefix}.running_var"),
                &[channels],
                Init::Ones,
            )?,
            eps: 1e-5,
            momentum: 0.1,
        })
    }

    pub fn forward(&self, x: &Tensor, ctx: &StageCtx) -> Result<Tensor> {
        self.apply(x, None, ctx, Activation::Identity)
    }

    /// BatchNorm then ReLU, fused where the fused kernel runs (it keeps only the input and the
    /// output for backward).
    pub fn forward_relu(&self, x: &Tensor, ctx: &StageCtx) -> Result<Tensor> {
        self.apply(x, None, ctx, Activation::Relu)
    }

    /// `relu(bn(x) + residual)`, a residual block's end, fused where the fused kernel runs (it
    /// keeps x and the output; the normalised tensor and the sum are never graph nodes).
    pub fn forward_add_relu(
        &self,
        x: &Tensor,
        residual: &Tensor,
        ctx: &StageCtx,
    ) -> Result<Tensor> {
        self.apply(x, Some(residual), ctx, Activation::Relu)
    }

    /// `relu(bn(x) + other(x_other))`, a downsampling residual block's end (its last BatchNorm and
    /// the projection's), one op where the fused kernel runs: it keeps x, x_other and the output;
    /// the projection's normalised tensor is never a graph node.
    pub fn forward_pair_relu(
        &self,
        x: &Tensor,
        other: &BatchNorm,
        x_other: &Tensor,
        ctx: &StageCtx,
    ) -> Result<Tensor> {
        if !(ctx.is_training() && crate::fused::lean(x)) {
            return self.forward_add_relu(x, &other.forward(x_other, ctx)?, ctx);
        }
        let (y, [(mean, var), (mean_o, var_o)]) = crate::fused::batch_norm_pair_train(
            (x, &self.weight, &self.bias),
            (x_other, &other.weight, &other.bias),
            self.eps,
        )?;
        if !ctx.is_recompute() {
            self.update_running(&mean, &var, Self::per_channel(x)?)?;
            other.update_running(&mean_o, &var_o, Self::per_channel(x_other)?)?;
        }
        Ok(y)
    }

    /// `conv3d(relu(bn(x)), w, g)`, for a BatchNorm + ReLU whose output only that convolution
    /// reads (inside a ResNet bottleneck, between a U-Net level's convolutions). In training, in
    /// f32 or f64, on the CPU kernels or the generic route, one op: it keeps x, which the
    /// BatchNorm keeps anyway, and never relu(bn(x)), which its backward makes again (one
    /// elementwise pass); on the kernels the same bits as the two ops. Elsewhere the two ops
    /// (half precision rounds relu(bn(x)) between them).
    pub fn forward_relu_conv3d(
        &self,
        x: &Tensor,
        w: &Tensor,
        g: Conv3dGeometry,
        ctx: &StageCtx,
    ) -> Result<Tensor> {
        if !self.one_op(x, ctx) {
            return crate::conv3d(&self.forward_relu(x, ctx)?, w, g);
        }
        // Recorded as the convolution it is: relu(bn(x)) has x's shape.
        recorded(ConvKind::Conv3d, &[x, w], g, || self.normalised_conv3d(x, w, g, ctx))
    }

    /// [`BatchNorm::forward_relu_conv3d`] of x (N, C, H, W) with w (O, C, kh, kw), one stride and
    /// padding for both sides (as `conv2d`): `conv2d(relu(bn(x)), w, padding, stride)`.
    pub fn forward_relu_conv2d(
        &self,
        x: &Tensor,
        w: &Tensor,
        padding: usize,
        stride: usize,
        ctx: &StageCtx,
    ) -> Result<Tensor> {
        if !self.one_op(x, ctx) {
            return crate::conv2d(&self.forward_relu(x, ctx)?, w, padding, stride);
        }
        let g = Conv3dGeometry { stride_d: 1, stride_hw: stride, pad_d: 0, pad_hw: padding };
        recorded(ConvKind::Conv2d, &[x, w], g, || {
            // At depth 1: the statistics are over the same elements of each channel.
            self.normalised_conv3d(&x.unsqueeze(2)?, &w.unsqueeze(2)?, g, ctx)?.squeeze(2)
        }) // (N, O, H', W')
    }

    /// Whether [`BatchNorm::forward_relu_conv3d`] runs as one op.
    fn one_op(&self, x: &Tensor, ctx: &StageCtx) -> bool {
        ctx.is_training() && crate::fused::lean(x) && matches!(x.dtype(), DType::F32 | DType::F64)
    }

    /// The one op of [`BatchNorm::forward_relu_conv3d`], and the running statistics' update.
    fn normalised_conv3d(
        &self,
        x: &Tensor,
        w: &Tensor,
        g: Conv3dGeometry,
        ctx: &StageCtx,
    ) -> Result<Tensor> {
        let normalised = (x, &self.weight, &self.bias);
        let (y, mean, var) = crate::fused::batch_norm_relu_conv3d(normalised, self.eps, w, g)?;
        if !ctx.is_recompute() {
            self.update_running(&mean, &var, Self::per_channel(x)?)?;
        }
        Ok(y)
    }

    /// Values per channel of x (N, C, *spatial): what a batch statistic averages over.
    fn per_channel(x: &Tensor) -> Result<f64> {
        Ok((x.elem_count() / x.dim(1)?) as f64)
    }

    fn apply(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        ctx: &StageCtx,
        activation: Activation,
    ) -> Result<Tensor> {
        let (c, n) = (x.dim(1)?, Self::per_channel(x)?);
        if ctx.is_training() && crate::fused::lean(x) {
            let (y, mean, var) = crate::fused::batch_norm_train(
                x,
                &self.weight,
                &self.bias,
                residual,
                self.eps,
                activation,
            )?;
            if !ctx.is_recompute() {
                self.update_running(&mean, &var, n)?;
            }
            return Ok(y);
        }
        // Composed in f32 at least: candle's CPU ops would reduce a half-precision x in its own
        // precision.
        let dtype = x.dtype();
        let (x, residual) =
            (&crate::fused::widened(x)?, residual.map(crate::fused::widened).transpose()?);
        let mut shape = vec![1; x.rank()];
        shape[1] = c; // (1, C, 1, ...): broadcasts over batch and space
        let reduce: Vec<usize> = (0..x.rank()).filter(|&d| d != 1).collect();
        let (mean, var) = if ctx.is_training() {
            let mean = x.mean_keepdim(reduce.as_slice())?;
            let centered = x.broadcast_sub(&mean)?;
            // Biased, as used to normalise.
            let var = centered.sqr()?.mean_keepdim(reduce.as_slice())?;
            if !ctx.is_recompute() {
                self.update_running(&mean.detach().reshape(c)?, &var.detach().reshape(c)?, n)?;
            }
            (mean, var)
        } else {
            (
                self.running_mean.as_tensor().reshape(shape.as_slice())?,
                self.running_var.as_tensor().reshape(shape.as_slice())?,
            )
        };
        let x_hat = x.broadcast_sub(&mean)?.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        let (weight, bias) =
            (crate::fused::widened(&self.weight)?, crate::fused::widened(&self.bias)?);
        let y = x_hat
            .broadcast_mul(&weight.reshape(shape.as_slice())?)?
            .broadcast_add(&bias.reshape(shape.as_slice())?)?;
        let y = match residual {
            Some(r) => (y + r)?,
            None => y,
        };
        let y = match activation {
            Activation::Relu => y.relu()?,
            Activation::Identity => y,
        };
        y.to_dtype(dtype)
    }

    /// The running statistics from a batch's per-channel mean and biased variance over `n`
    /// values per channel (the running variance takes the unbiased one, as PyTorch's).
    fn update_running(&self, mean: &Tensor, biased_var: &Tensor, n: f64) -> Result<()> {
        self.update(&self.running_mean, mean)?;
        self.update(&self.running_var, &(biased_var * (n / (n - 1.0).max(1.0)))?)
    }

    fn update(&self, stat: &Var, batch: &Tensor) -> Result<()> {
        let new = ((stat.as_tensor() * (1.0 - self.momentum))?
            + (batch.to_dtype(DType::F32)? * self.momentum)?)?;
        stat.set(&new)
    }

    /// The running statistics (mean, var), e.g. to compare two runs bit for bit.
    pub fn running_stats(&self) -> (Tensor, Tensor) {
        (self.running_mean.as_tensor().clone(), self.running_var.as_tensor().clone())
    }
}
