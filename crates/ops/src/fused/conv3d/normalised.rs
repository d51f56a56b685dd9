//! The convolution of a BatchNorm + ReLU's output, `conv3d(relu(bn(x)), w)`, as one op
//! ([`NormalisedConvOp`]) that keeps x and never the normalised tensor relu(bn(x)): its backward
//! normalises x again (one elementwise pass) for the weight gradient and the ReLU's mask. The
//! BatchNorm keeps x anyway, so where only the convolution reads relu(bn(x)) (inside a ResNet
//! bottleneck, between a U-Net level's two convolutions) that tensor is gone from the step: two of
//! a bottleneck's twelve, which PyTorch keeps. The BatchNorm's and the convolution's own kernels
//! in the order the two ops run them: the same bits. On the generic route
//! (`normalised_conv3d_generic`) the BatchNorm's and the convolution's compositions in one op,
//! keeping what the kernel keeps. Not here: the layer that calls it
//! (`BatchNorm::forward_relu_conv3d`), which composes the two ops where this one does not apply.

use super::input::Input;
use super::op::Conv3dOp;
use super::shape::Conv3dShape;
use super::{Conv3dGeometry, Kernel, BLOCK_ENTRIES};
use crate::fused::batch_norm::{normalise, normalise_backward, Activation, BatchNormOp};
use crate::fused::composed::{conv3d_composed, conv3d_composed_backward};
use crate::fused::dtype::{operand, widened_as};
use crate::fused::generic::GenericOp;
use crate::fused::op::{exactly, FusedOp, Operand, Want};
use crate::fused::replay::{apply3, kept_or, Replay};
use crate::fused::route::generic;
use crate::fused::storage::{shaped, slice, with_slice};
use candle_core::{CpuStorage, DType, Result, Shape, Tensor};
use remat::keep::OpKind;

/// `conv3d(relu(bn(x)), w, g)` in training mode, for x (N, C, D, H, W) with its batch statistics,
/// the BatchNorm's `weight` and `bias` (C) and `eps`, and w (O, C, kd, kh, kw), as one op that
/// keeps x, (weight; bias) and w. Returns the output and the batch's per-channel mean and biased
/// variance (C) (for the running statistics). For f32 and f64 tensors that take the kernel or the
/// generic route (`lean`): in half precision the two ops round the normalised tensor between them,
/// which this op would not, so it refuses it.
pub fn batch_norm_relu_conv3d(
    normalised: crate::fused::Normalised,
    eps: f64,
    w: &Tensor,
    g: Conv3dGeometry,
) -> Result<(Tensor, Tensor, Tensor)> {
    let x = normalised.0;
    if !matches!(x.dtype(), DType::F32 | DType::F64) {
        candle_core::bail!("batch_norm_relu_conv3d: f32 or f64 only, got {:?}", x.dtype())
    }
    let mut stats = None;
    let y = remat::keep::op(OpKind::Conv, |kept| {
        let (y, s) = match generic(x) {
            true => normalised_conv3d_generic(normalised, eps, w, g, kept),
            false => normalised_conv3d(normalised, eps, w, g, kept),
        }?;
        stats = Some(s);
        Ok(y)
    })?;
    let (mean, var) = stats.expect("keep::op runs the op");
    Ok((y, mean, var))
}

/// [`batch_norm_relu_conv3d`] on the CPU kernels; `kept`: its output, kept from the forward
/// (`remat::keep`).
fn normalised_conv3d(
    (x, weight, bias): crate::fused::Normalised,
    eps: f64,
    w: &Tensor,
    g: Conv3dGeometry,
    kept: Option<Tensor>,
) -> Result<(Tensor, (Tensor, Tensor))> {
    let x = x.contiguous()?;
    let (norm, stats) = BatchNormOp::of(&x, eps, Activation::Relu)?;
    let shape = Conv3dShape::new(x.dims5()?, w.dims5()?, g, BLOCK_ENTRIES)?.sized();
    let conv = Conv3dOp { shape, split: None };
    // Weight and bias travel as one (2, C) operand, as the BatchNorm op's, so that the
    // convolution's weight fits a three-input op.
    let wb = operand(&Tensor::stack(&[weight, bias], 0)?, &x)?;
    let y = apply3(&x, &wb, &operand(w, &x)?, NormalisedConvOp { norm, conv }, kept)?;
    Ok((y, stats))
}

/// [`batch_norm_relu_conv3d`] on the generic route: BatchNorm + ReLU composed on the detached x (the
/// `batch_norm` module's), then the composed convolution, in one op; its backward composes them
/// again, relu(bn(x)) made anew. Keeps what the kernel keeps: x, (weight; bias) and w. For f32
/// and f64, as the kernel.
fn normalised_conv3d_generic(
    (x, weight, bias): crate::fused::Normalised,
    eps: f64,
    w: &Tensor,
    g: Conv3dGeometry,
    kept: Option<Tensor>,
) -> Result<(Tensor, (Tensor, Tensor))> {
    let wb = Tensor::stack(&[weight, bias], 0)?; // (2, C): the op's operand, as on the kernel
    let (y, mean, var) = normalise(x, &widened_as(&wb.detach(), x)?, None, eps, Activation::Relu)?;
    let out = kept_or(kept, || conv3d_composed(&y, &widened_as(&w.detach(), x)?, g))?;
    drop(y);
    let backward = move |inputs: &[Tensor],
                         _: &Tensor,
                         grad: &Tensor,
                         want: &[bool]|
          -> Result<Vec<Option<Tensor>>> {
        let [x, wb, w] = exactly(&inputs.iter().collect::<Vec<_>>())?;
        let wb_w = widened_as(wb, x)?;
        let (y, _, _) = normalise(x, &wb_w, None, eps, Activation::Relu)?; // the forward's
        let want = Want { dx: want[0] || want[1], dw: want[2] };
        let (dy, dw) = conv3d_composed_backward(&y, &widened_as(w, x)?, grad, g, want)?;
        let (dx, dwb) = match dy {
            Some(dy) => {
                let (dx, dwb, _) = normalise_backward(x, &wb_w, &y, &dy, eps, Activation::Relu)?;
                (Some(dx), Some(dwb.to_dtype(wb.dtype())?))
            }
            None => (None, None),
        };
        Ok(vec![dx, dwb, dw.map(|dw| dw.to_dtype(w.dtype())).transpose()?])
    };
    let op = GenericOp::new("generic-normalised-conv3d", out, Box::new(backward));
    Ok((x.contiguous()?.apply_op3(&wb, &w.contiguous()?, op)?, (mean, var)))
}

/// The BatchNorm (with its ReLU and the batch's statistics) and the convolution that reads its
/// output. Operands x, (weight; bias) (2, C) and the convolution's weight.
pub(crate) struct NormalisedConvOp {
    norm: BatchNormOp,
    conv: Conv3dOp,
}

impl FusedOp for NormalisedConvOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let [(x, xl), (wb, wbl), (w, wl)] = exactly(inputs)?;
        let s = &self.conv.shape;
        let out = per_float!(x, "normalised_conv3d", {
            let y = self.norm.forward(&slice(x, xl)?, &slice(wb, wbl)?, None); // dropped here
            s.convolve_any(Input::whole(&y, s.c), &slice(w, wl)?, Kernel::AsIs, &[s.o]).remove(0)
        });
        Ok((out, Shape::from(vec![s.n, s.o, s.output[0], s.output[1], s.output[2]])))
    }

    fn bwd(&self, inputs: &[&Tensor], _out: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [x, wb, w] = exactly(inputs)?;
        let g = g.contiguous()?;
        // The normalised tensor's gradient is wanted for x's and for the BatchNorm's parameters.
        let want = Want { dx: x.track_op() || wb.track_op(), dw: w.track_op() };
        let (norm, dw) = per_dtype!(x.dtype(), T => {
            let grads = |xs: &[T], wbs: &[T], ws: &[T], gs: &[T]| {
                let y = self.norm.forward(xs, wbs, None); // the forward's, bit for bit
                let (mut dys, dw) =
                    self.conv.backward(Input::whole(&y, self.conv.shape.c), ws, gs, want)?;
                let norm = match dys.pop() {
                    Some(dy) => Some(self.norm.backward(xs, &y, wbs, &dy, false)),
                    None => None, // not wanted, not computed
                };
                Ok((norm, dw))
            };
            let (norm, dw) = with_slice::<T, _>(x, |xs| {
                with_slice(wb, |wbs| {
                    with_slice(w, |ws| with_slice(&g, |gs| grads(xs, wbs, ws, gs)))
                })
            })?;
            let norm = norm
                .map(|(dx, dwb, _)| Ok::<_, candle_core::Error>((shaped(dx, x)?, shaped(dwb, wb)?)))
                .transpose()?;
            (norm, want.dw.then(|| shaped(dw, w)).transpose()?)
        });
        let (dx, dwb) = norm.unzip();
        Ok(vec![dx, dwb, dw])
    }
}

custom_op!(NormalisedConvOp: 3 "fused-normalised-conv3d");
custom_op!(Replay<NormalisedConvOp>: 3 "replayed-normalised-conv3d");
