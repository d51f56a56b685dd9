//! The convolution of a BatchNorm + ReLU's output, `conv3d(relu(bn(x)), w)`, as one op
//! ([`NormalisedConvOp`]) that keeps x and never the normalised tensor relu(bn(x)): its backward
//! normalises x again (one elementwise pass) for the weight gradient and the ReLU's mask. The
//! BatchNorm keeps x anyway, so where only the convolution reads relu(bn(x)) (inside a ResNet
//! bottleneck, between a U-Net level's two convolutions) that tensor is gone from the step: two of
//! a bottleneck's twelve, which PyTorch keeps. The BatchNorm's and the convolution's own kernels
//! in the order the two ops run them: the same bits. Not here: the layer that calls it
//! (`BatchNorm::forward_relu_conv3d`), which composes the two ops where this one does not apply.

use super::input::Input;
use super::op::Conv3dOp;
use super::shape::Conv3dShape;
use super::{Conv3dGeometry, Kernel, BLOCK_ENTRIES};
use crate::fused::batch_norm::{Activation, BatchNormOp};
use crate::fused::dtype::operand;
use crate::fused::op::{exactly, FusedOp, Operand, Want};
use crate::fused::replay::{apply3, Replay};
use crate::fused::storage::{shaped, slice, with_slice};
use candle_core::{CpuStorage, Result, Shape, Tensor};

/// `conv3d(relu(bn(x)), w, g)` in training mode, for x (N, C, D, H, W) with its batch statistics,
/// the BatchNorm's `weight` and `bias` (C) and `eps`, and w (O, C, kd, kh, kw). Returns the
/// output and the batch's per-channel mean and biased variance (C) (for the running statistics).
/// `kept`: its output, kept from the forward (`remat::keep`). For f32 and f64 on the CPU kernels:
/// in half precision the two ops round the normalised tensor between them, which this op would not.
pub(crate) fn normalised_conv3d(
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
