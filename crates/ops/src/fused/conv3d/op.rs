//! The 3D convolution as one candle custom op ([`Conv3dOp`]): its forward, and its backward's
//! operands read and gradients returned as tensors, one input tensor or two. Not here: the
//! gradients' computation (`backward`).

use super::input::Input;
use super::shape::Conv3dShape;
use super::Kernel;
use crate::fused::op::{FusedOp, Operand, Want};
use crate::fused::replay::Replay;
use crate::fused::storage::{shaped, slice, with_slice};
use candle_core::{CpuStorage, Result, Shape, Tensor};

pub(super) struct Conv3dOp {
    pub(super) shape: Conv3dShape,
    /// The input comes as two tensors, the first with this many channels
    /// ([`conv3d_concat`](super::conv3d_concat)).
    pub(super) split: Option<usize>,
}

impl Conv3dOp {
    /// The input's channels as its tensors hold them: one part, or two.
    pub(super) fn parts(&self) -> Vec<usize> {
        match self.split {
            Some(split) => vec![split, self.shape.c - split],
            None => vec![self.shape.c],
        }
    }
}

impl FusedOp for Conv3dOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let s = &self.shape;
        let ((x, xl), (w, wl)) = (inputs[0], inputs[inputs.len() - 1]);
        let y = per_float!(x, "conv3d", {
            let w = slice(w, wl)?;
            let first = slice(x, xl)?;
            let second = inputs
                .get(1)
                .filter(|_| inputs.len() == 3)
                .map(|&(b, bl)| slice(b, bl))
                .transpose()?;
            let input = Input {
                first: &first,
                second: second.as_deref().unwrap_or(&[]),
                split: self.split.unwrap_or(s.c),
            };
            s.convolve_any(input, &w, Kernel::AsIs, &[s.o]).remove(0)
        });
        Ok((y, Shape::from(vec![s.n, s.o, s.output[0], s.output[1], s.output[2]])))
    }

    fn bwd(&self, inputs: &[&Tensor], _y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let (x, w) = (inputs[0], inputs[inputs.len() - 1]);
        let second = (inputs.len() == 3).then(|| inputs[1]);
        let g = g.contiguous()?;
        let parts = &inputs[..inputs.len() - 1];
        let want = Want { dx: parts.iter().any(|x| x.track_op()), dw: w.track_op() };
        let (dxs, dw) = per_dtype!(x.dtype(), T => {
            let split = self.split.unwrap_or(self.shape.c);
            let (dxs, dw) = with_slice::<T, _>(x, |xs| {
                let run = |bs: &[T]| {
                    with_slice(w, |ws| {
                        with_slice(&g, |gs| {
                            self.backward(Input { first: xs, second: bs, split }, ws, gs, want)
                        })
                    })
                };
                match second {
                    Some(b) => with_slice(b, run),
                    None => run(&[]),
                }
            })?;
            // Not wanted, dx was not computed: no gradient for any part.
            let dxs = match want.dx {
                true => dxs
                    .into_iter()
                    .zip(parts)
                    .map(|(dx, x)| x.track_op().then(|| shaped(dx, x)).transpose())
                    .collect::<Result<Vec<_>>>()?,
                false => vec![None; parts.len()],
            };
            (dxs, want.dw.then(|| shaped(dw, w)).transpose()?)
        });
        Ok(dxs.into_iter().chain([dw]).collect())
    }
}

custom_op!(Conv3dOp: 2 "fused-conv3d", 3 "fused-conv3d-concat");
custom_op!(Replay<Conv3dOp>: 2 "replayed-conv3d", 3 "replayed-conv3d-concat");
