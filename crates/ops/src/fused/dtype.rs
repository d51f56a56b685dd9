//! The dtype a fused op computes in: half precision (bf16, f16) widened to f32, f32 and f64 as
//! they are; beside a half-precision input, each other operand read in its own dtype (an f32
//! weight stays f32, and so does its gradient). Not here: reading and writing a CPU storage's
//! elements (`storage`).

use candle_core::{DType, Result, Tensor};

/// `t` in f32 if it is in half precision, else as it is: for the composed ops that have no
/// half-precision path on the CPU (they then keep the f32 copy for backward).
pub fn widened(t: &Tensor) -> Result<Tensor> {
    widened_as(t, t)
}

/// `t` in the dtype an op on `x` computes in: f32 beside a half-precision `x`, else `x`'s dtype.
/// What the generic route reads an operand or a gradient as next to its input.
pub(crate) fn widened_as(t: &Tensor, x: &Tensor) -> Result<Tensor> {
    t.to_dtype(if is_half(x.dtype()) { DType::F32 } else { x.dtype() })
}

/// bf16 or f16: the kernels widen it to f32.
pub fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// `t` as a fused kernel reads it next to an input `x`: in `x`'s dtype, except beside a
/// half-precision `x`, where it stays as stored (an f32 weight is read as is, its gradient made in
/// f32, with no half-precision copy kept); contiguous.
pub(crate) fn operand(t: &Tensor, x: &Tensor) -> Result<Tensor> {
    if is_half(x.dtype()) {
        t.contiguous()
    } else {
        t.to_dtype(x.dtype())?.contiguous()
    }
}
