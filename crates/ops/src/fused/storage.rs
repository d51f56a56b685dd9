//! A CPU tensor's elements as the kernels read and write them: a storage's contiguous elements
//! as a slice of the compute type (borrowed, or widened from half precision), a kernel's f32
//! result narrowed back, a gradient's elements as a tensor shaped like its operand. Not here:
//! which dtype an op computes in (`dtype`).

use candle_core::{CpuStorage, DType, Layout, Result, Storage, Tensor, WithDType};
use std::borrow::Cow;

/// The contiguous elements of a CPU storage as `T`: borrowed where it holds `T`, converted (a
/// copy) where it holds another float type (half precision widened to f32).
pub fn slice<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout) -> Result<Cow<'a, [T]>> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("fused op: input is not contiguous".into()))?;
    fn convert<S: WithDType, T: WithDType>(v: &[S]) -> Cow<'static, [T]> {
        Cow::Owned(v.iter().map(|x| T::from_f64(x.to_f64())).collect())
    }
    Ok(match s {
        CpuStorage::BF16(v) if T::DTYPE != DType::BF16 => convert(&v[start..end]),
        CpuStorage::F16(v) if T::DTYPE != DType::F16 => convert(&v[start..end]),
        CpuStorage::F32(v) if T::DTYPE != DType::F32 => convert(&v[start..end]),
        CpuStorage::F64(v) if T::DTYPE != DType::F64 => convert(&v[start..end]),
        _ => Cow::Borrowed(&s.as_slice::<T>()?[start..end]),
    })
}

/// A kernel's f32 result stored as the half-precision type `H`.
pub(crate) fn narrow<H: WithDType>(v: Vec<f32>) -> Vec<H> {
    v.into_iter().map(|x| H::from_f64(x as f64)).collect()
}

/// Runs `f` on the contiguous elements of a CPU tensor.
pub(crate) fn with_slice<T: WithDType, R>(
    t: &Tensor,
    f: impl FnOnce(&[T]) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => f(&slice::<T>(s, layout)?),
        _ => candle_core::bail!("fused op: tensor is not on the CPU"),
    }
}

/// A gradient's elements as a tensor shaped, placed and typed like `like`.
pub(crate) fn shaped<T: WithDType>(v: Vec<T>, like: &Tensor) -> Result<Tensor> {
    Tensor::from_vec(v, like.shape(), like.device())?.to_dtype(like.dtype())
}
