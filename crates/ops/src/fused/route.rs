//! Which implementation a fused op takes for a tensor: its CPU kernel ([`fused`]), its
//! device-generic route ([`generic`]: a CUDA tensor, or a CPU one with [`set_path`] forcing it,
//! where the tests prove it), or, where neither applies ([`lean`] false: Metal, integer tensors),
//! candle's composed ops. Not here: the generic route itself (the `generic` module).

use candle_core::{DType, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};

/// Which implementation the fused ops take on the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// The CPU kernels.
    Kernel,
    /// The device-generic route, as on other devices.
    Generic,
}

static GENERIC: AtomicBool = AtomicBool::new(false);

/// Sets the path every fused op of this process takes on the CPU (tests and measurements).
pub fn set_path(path: Path) {
    GENERIC.store(path == Path::Generic, Ordering::Relaxed);
}

pub fn path() -> Path {
    if GENERIC.load(Ordering::Relaxed) {
        Path::Generic
    } else {
        Path::Kernel
    }
}

/// Whether an op with a generic form takes it for `t`: a float tensor on a CUDA device, or on the
/// CPU with the path forced.
pub(crate) fn generic(t: &Tensor) -> bool {
    t.dtype().is_float()
        && (t.device().is_cuda() || (t.device().is_cpu() && path() == Path::Generic))
}

/// The fused path applies: a float tensor on the CPU, the kernels not set aside ([`set_path`]).
pub fn fused(t: &Tensor) -> bool {
    path() == Path::Kernel
        && t.device().is_cpu()
        && matches!(t.dtype(), DType::F32 | DType::F64 | DType::BF16 | DType::F16)
}

/// The op's own implementation applies, the CPU kernel or the generic route, rather than candle's
/// composed ops.
pub(crate) fn lean(t: &Tensor) -> bool {
    fused(t) || generic(t)
}
