//! The device-generic route of the 3D convolution ([`crate::fused::generic`]): candle's 2D
//! convolutions summed over kernel depth on detached operands, and their backward composed the
//! same way (the `composed` module's), half precision computed in f32; of two tensors' channels
//! side by side, the concatenation made inside the op and dropped there. Keeps what the kernel
//! keeps. Not here: the CPU kernel (the rest of `conv3d`).

use super::concat_dims;
use super::Conv3dGeometry;
use crate::fused::composed::{conv3d_composed, conv3d_composed_backward};
use crate::fused::dtype::{widened, widened_as};
use crate::fused::generic::GenericOp;
use crate::fused::op::{exactly, Want};
use crate::fused::replay::kept_or;
use candle_core::{Result, Tensor};

/// The generic route ([`crate::fused::generic`]): candle's 2D convolutions summed over kernel depth
/// on detached operands, and their backward composed the same way (the `composed` module's), half
/// precision computed in f32. Keeps what the kernel keeps: x and w.
pub(crate) fn conv3d_generic(
    x: &Tensor,
    w: &Tensor,
    g: Conv3dGeometry,
    kept: Option<Tensor>,
) -> Result<Tensor> {
    let y = kept_or(kept, || {
        conv3d_composed(&widened(&x.detach())?, &widened_as(&w.detach(), x)?, g)?
            .to_dtype(x.dtype())
    })?;
    let backward = move |inputs: &[Tensor],
                         _y: &Tensor,
                         grad: &Tensor,
                         want: &[bool]|
          -> Result<Vec<Option<Tensor>>> {
        let [x, w] = exactly(&inputs.iter().collect::<Vec<_>>())?;
        let (dx, dw) = conv3d_composed_backward(
            &widened(x)?,
            &widened_as(w, x)?,
            &widened_as(grad, x)?,
            g,
            Want { dx: want[0], dw: want[1] },
        )?;
        Ok(vec![
            dx.map(|dx| dx.to_dtype(x.dtype())).transpose()?,
            dw.map(|dw| dw.to_dtype(w.dtype())).transpose()?,
        ])
    };
    x.contiguous()?
        .apply_op2(&w.contiguous()?, GenericOp::new("generic-conv3d", y, Box::new(backward)))
}

/// The generic route of [`conv3d_concat`]: as [`conv3d_generic`], the concatenation made inside
/// the op (forward and backward) and dropped there. Keeps what the kernel keeps: a, b and w.
pub(crate) fn conv3d_concat_generic(
    a: &Tensor,
    b: &Tensor,
    w: &Tensor,
    g: Conv3dGeometry,
    kept: Option<Tensor>,
) -> Result<Tensor> {
    let split = concat_dims(a, b)?.1;
    let y = kept_or(kept, || {
        let x = Tensor::cat(&[&widened(&a.detach())?, &widened(&b.detach())?], 1)?;
        conv3d_composed(&x, &widened_as(&w.detach(), a)?, g)?.to_dtype(a.dtype())
    })?;
    let backward = move |inputs: &[Tensor],
                         _y: &Tensor,
                         grad: &Tensor,
                         want: &[bool]|
          -> Result<Vec<Option<Tensor>>> {
        let [a, b, w] = exactly(&inputs.iter().collect::<Vec<_>>())?;
        let x = Tensor::cat(&[&widened(a)?, &widened(b)?], 1)?;
        let (dx, dw) = conv3d_composed_backward(
            &x,
            &widened_as(w, a)?,
            &widened_as(grad, a)?,
            g,
            Want { dx: want[0] || want[1], dw: want[2] },
        )?;
        let part = |t: &Tensor, (start, len), like: &Tensor, wanted: bool| {
            wanted
                .then(|| t.narrow(1, start, len)?.to_dtype(like.dtype())?.contiguous())
                .transpose()
        };
        let (da, db) = match &dx {
            Some(dx) => (
                part(dx, (0, split), a, want[0])?,
                part(dx, (split, dx.dim(1)? - split), b, want[1])?,
            ),
            None => (None, None),
        };
        Ok(vec![da, db, dw.map(|dw| dw.to_dtype(w.dtype())).transpose()?])
    };
    a.contiguous()?.apply_op3(
        &b.contiguous()?,
        &w.contiguous()?,
        GenericOp::new("generic-conv3d-concat", y, Box::new(backward)),
    )
}
