//! The device-generic route of the fused ops: an op's forward and backward composed from candle's
//! own tensor ops on detached operands, recorded as one custom op over the operands, so nothing of
//! the composition enters candle's graph and the op keeps for backward what its CPU kernel keeps
//! (its operands and its output). The price is one copy of the output: candle makes a custom op's
//! output from the storage its forward returns. [`set_path`] forces the route on the CPU, so that
//! what it keeps can be measured without a GPU; ops without a generic form yet take the composed
//! ops there, as every device but the CPU still does.

use super::is_half;
use candle_core::{CpuStorage, DType, Layout, Result, Shape, Storage, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

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

/// Whether an op with a generic form takes it for `t`: a float tensor on the CPU with the path
/// forced. (On a GPU it will once the ops have their device forward; until then the composed ops.)
pub(crate) fn generic(t: &Tensor) -> bool {
    path() == Path::Generic && t.device().is_cpu() && t.dtype().is_float()
}

/// `t` in f32 where it is in half precision: the composed backward computes in f32.
pub(super) fn wide(t: &Tensor) -> Result<Tensor> {
    if is_half(t.dtype()) {
        t.to_dtype(DType::F32)
    } else {
        Ok(t.clone())
    }
}

/// The gradients of an op's operands from its detached operands, output and output gradient.
type Backward = dyn Fn(&[Tensor], &Tensor, &Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync;

/// A composed forward's result recorded as one op over its operands, with its composed backward.
pub(super) struct GenericOp {
    name: &'static str,
    /// Taken by the forward: the op does not hold a second copy of its output.
    out: Mutex<Option<Tensor>>,
    backward: Box<Backward>,
}

impl GenericOp {
    pub(super) fn new(name: &'static str, out: Tensor, backward: Box<Backward>) -> Self {
        GenericOp { name, out: Mutex::new(Some(out)), backward }
    }

    fn forward(&self) -> Result<(CpuStorage, Shape)> {
        let out = self.out.lock().map_err(|_| candle_core::Error::Msg(format!("{}: poisoned", self.name)))?.take();
        let out = out.ok_or_else(|| candle_core::Error::Msg(format!("{}: forward ran twice", self.name)))?.contiguous()?;
        let (storage, layout) = out.storage_and_layout();
        let whole = layout.start_offset() == 0 && storage_len(&storage) == Some(out.elem_count());
        match &*storage {
            Storage::Cpu(s) if whole => Ok((s.clone(), out.shape().clone())),
            _ => candle_core::bail!("{}: the composed output is not a whole CPU tensor", self.name),
        }
    }

    fn grads(&self, inputs: &[&Tensor], out: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let inputs: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
        (self.backward)(&inputs, &out.detach(), &grad.detach())
    }
}

/// The elements a CPU storage holds.
fn storage_len(s: &Storage) -> Option<usize> {
    match s {
        Storage::Cpu(c) => Some(match c {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F64(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::F16(v) => v.len(),
            _ => return None,
        }),
        _ => None,
    }
}

impl candle_core::CustomOp1 for GenericOp {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.forward()
    }

    fn bwd(&self, x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(self.grads(&[x], y, g)?.into_iter().next().flatten())
    }
}

impl candle_core::CustomOp2 for GenericOp {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.forward()
    }

    fn bwd(&self, x1: &Tensor, x2: &Tensor, y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut grads = self.grads(&[x1, x2], y, g)?.into_iter();
        Ok((grads.next().flatten(), grads.next().flatten()))
    }
}

impl candle_core::CustomOp3 for GenericOp {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.forward()
    }

    fn bwd(&self, x1: &Tensor, x2: &Tensor, x3: &Tensor, y: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut grads = self.grads(&[x1, x2, x3], y, g)?.into_iter();
        Ok((grads.next().flatten(), grads.next().flatten(), grads.next().flatten()))
    }
}
