//! The float types the kernels run in, f32 and f64 ([`Elem`]), and the conversions and compare
//! they share: constants into the type, elements widened to f64, a maximum that a NaN wins. Not
//! here: half precision, which the kernels read widened to f32 (`storage`).

use candle_core::WithDType;
use num_traits::Float;

/// A float type the kernels run in.
pub(crate) trait Elem:
    WithDType
    + Float
    + Send
    + Sync
    + std::iter::Sum
    + std::ops::AddAssign
    + std::ops::SubAssign
    + std::ops::MulAssign
{
    /// `v` as f32 elements, where this type is f32: what the kernels written for f32 alone take.
    fn f32s(v: &[Self]) -> Option<&[f32]>;

    /// `v` as f32 elements to write, where this type is f32.
    fn f32s_mut(v: &mut [Self]) -> Option<&mut [f32]>;

    /// f32 elements as this type's, where it is f32.
    fn from_f32s(v: Vec<f32>) -> Option<Vec<Self>>;

    /// Every element replaced by its exp: many at once in f32 (`exp`), one by one in f64.
    fn exp_in_place(xs: &mut [Self]);
}

impl Elem for f32 {
    fn f32s(v: &[f32]) -> Option<&[f32]> {
        Some(v)
    }

    fn f32s_mut(v: &mut [f32]) -> Option<&mut [f32]> {
        Some(v)
    }

    fn from_f32s(v: Vec<f32>) -> Option<Vec<f32>> {
        Some(v)
    }

    fn exp_in_place(xs: &mut [f32]) {
        super::exp::exp_in_place(xs)
    }
}

impl Elem for f64 {
    fn f32s(_: &[f64]) -> Option<&[f32]> {
        None
    }

    fn f32s_mut(_: &mut [f64]) -> Option<&mut [f32]> {
        None
    }

    fn from_f32s(_: Vec<f32>) -> Option<Vec<f64>> {
        None
    }

    fn exp_in_place(xs: &mut [f64]) {
        xs.iter_mut().for_each(|x| *x = x.exp());
    }
}

pub(crate) fn elem<T: Elem>(x: f64) -> T {
    T::from(x).expect("a finite constant")
}

pub(crate) fn wide<T: Elem>(v: T) -> f64 {
    WithDType::to_f64(v)
}

/// The larger of `m` and `v`, NaN winning, as PyTorch's reductions: `Float::max` ignores a NaN,
/// so a NaN would vanish from a row's maximum (an all-NaN softmax row would come out as zeros).
pub(crate) fn nan_max<T: Elem>(m: T, v: T) -> T {
    if v.is_nan() || v > m {
        v
    } else {
        m
    }
}
