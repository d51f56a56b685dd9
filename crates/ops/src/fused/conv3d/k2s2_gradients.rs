//! The up-convolution's gradients by the direct kernels: a transposed convolution with kernel =
//! stride = 2 has as its input gradient the stride-2 convolution of its output gradient with its
//! kernel, and as its weight gradient that convolution's weight gradient with its input as the
//! output gradient. Not here: the up-convolution itself (`fused::conv_transpose3d`).

use super::input::Input;
use super::shape::{Conv3dGeometry, Conv3dShape};
use super::{direct, Kernel, BLOCK_ENTRIES};
use crate::fused::elem::Elem;
use crate::fused::op::Want;

/// An input gradient and a weight gradient, each where it was asked for.
pub(crate) type Gradients<T> = (Option<Vec<T>>, Option<Vec<T>>);

/// The input and weight gradients of a transposed convolution with kernel = stride = 2 of x (N,
/// C, D, H, W) by w (C, O, 2, 2, 2), from its output gradient gy (N, O, 2D, 2H, 2W), by the
/// direct kernels where they take it (f32): dx is the convolution of gy with w at stride 2 (each
/// input voxel's gradient is what its 2x2x2 output block's gradient makes through w), and dW that
/// convolution's weight gradient with x as its output gradient. Each where `want` asks for it;
/// `None` where the direct kernels do not take it.
pub(crate) fn k2s2_gradients_directly<T: Elem>(
    x: &[T],
    w: &[T],
    gy: &[T],
    (n, c, o, [d, h, wd]): (usize, usize, usize, [usize; 3]),
    want: Want,
) -> Option<Gradients<T>> {
    let g = Conv3dGeometry { stride_d: 2, stride_hw: 2, pad_d: 0, pad_hw: 0 };
    let s = Conv3dShape::new((n, o, 2 * d, 2 * h, 2 * wd), (c, o, 2, 2, 2), g, BLOCK_ENTRIES)
        .ok()?
        .sized();
    let (plan, weight_plan) = (direct::Plan::of(&s)?, direct::WeightPlan::of(&s)?);
    let (x, w, gy) = (T::f32s(x)?, T::f32s(w)?, T::f32s(gy)?);
    let gy = Input::whole(gy, o);
    let dx = want.dx.then(|| direct::convolve(&s, plan, gy, w, Kernel::AsIs, &s.part_ranges(&[c])));
    let dw = want.dw.then(|| direct::weight_gradient(&s, weight_plan, gy, x));
    let typed = |v: Option<Vec<f32>>| match v {
        Some(v) => T::from_f32s(v).map(Some),
        None => Some(None),
    };
    Some((typed(dx.map(|mut dx| dx.remove(0)))?, typed(dw)?))
}
