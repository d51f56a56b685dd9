//! The device-generic route of the fused ops: an op's forward and backward composed from candle's
//! own tensor ops on detached operands, recorded as one custom op over the operands, so nothing of
//! the composition enters candle's graph and the op keeps for backward what its CPU kernel keeps
//! (its operands and its output). The price is one copy of the output: candle makes a custom op's
//! output from the storage its forward returns. CUDA tensors take this route; [`set_path`] forces
//! it on the CPU, so that what it keeps can be measured without a GPU.

use super::FusedOp;
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, Layout, Result, Shape, Storage, Tensor};
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

/// Whether an op with a generic form takes it for `t`: a float tensor on a CUDA device, or on the
/// CPU with the path forced.
pub(crate) fn generic(t: &Tensor) -> bool {
    t.dtype().is_float()
        && (t.device().is_cuda() || (t.device().is_cpu() && path() == Path::Generic))
}

/// The gradients of an op's operands from its detached operands, output and output gradient,
/// and which operands want one (some variable leads to them: not a frozen weight, not an image).
type Backward =
    dyn Fn(&[Tensor], &Tensor, &Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync;

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

    fn forward<S>(&self, pick: impl Fn(&Storage) -> Option<&S>) -> Result<(S, Shape)>
    where
        S: BackendStorage,
        S::Device: BackendDevice<Storage = S>,
    {
        copied(self.name, &self.out, pick)
    }

    fn grads(
        &self,
        inputs: &[&Tensor],
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let want: Vec<bool> = inputs.iter().map(|t| t.track_op()).collect();
        let inputs: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
        (self.backward)(&inputs, &out.detach(), &grad.detach(), &want)
    }
}

/// The output an op was given (`slot`, taken: the op holds no second copy) as a fresh storage of
/// the device `pick` selects: candle makes a custom op's output from the storage its forward
/// returns, so the output is copied once.
fn copied<S>(
    name: &str,
    slot: &Mutex<Option<Tensor>>,
    pick: impl Fn(&Storage) -> Option<&S>,
) -> Result<(S, Shape)>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    let poisoned = |_| candle_core::Error::Msg(format!("{name}: poisoned"));
    let out = slot.lock().map_err(poisoned)?.take();
    let out = out.ok_or_else(|| candle_core::Error::Msg(format!("{name}: forward ran twice")))?;
    let (storage, layout) = out.storage_and_layout();
    let Some(s) = pick(&storage) else {
        candle_core::bail!("{name}: the given output is on another device")
    };
    // SAFETY: every element of the new storage is written by the copy below.
    let mut copy = unsafe { s.device().alloc_uninit(out.shape(), out.dtype())? };
    s.copy_strided_src(&mut copy, 0, layout)?;
    Ok((copy, out.shape().clone()))
}

/// A fused op whose output is given: the output its forward kept under selective recompute
/// (`remat::keep`), replayed in the recompute. Its forward copies that output; its backward is
/// the op's, so the gradients are the op's own.
pub(super) struct Replay<O> {
    op: O,
    out: Mutex<Option<Tensor>>,
}

impl<O: FusedOp> Replay<O> {
    pub(super) fn new(op: O, out: Tensor) -> Self {
        Replay { op, out: Mutex::new(Some(out)) }
    }
}

impl<O: FusedOp> FusedOp for Replay<O> {
    fn cpu_fwd(&self, _: &[super::Operand]) -> Result<(CpuStorage, Shape)> {
        copied("replayed op", &self.out, cpu)
    }

    fn bwd(&self, inputs: &[&Tensor], out: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        self.op.bwd(inputs, out, grad)
    }
}

fn cpu(s: &Storage) -> Option<&CpuStorage> {
    match s {
        Storage::Cpu(s) => Some(s),
        _ => None,
    }
}

#[cfg(feature = "cuda")]
fn cuda(s: &Storage) -> Option<&candle_core::CudaStorage> {
    match s {
        Storage::Cuda(s) => Some(s),
        _ => None,
    }
}

impl candle_core::CustomOp1 for GenericOp {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.forward(cpu)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.forward(cuda)
    }

    fn bwd(&self, x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(self.grads(&[x], y, g)?.into_iter().next().flatten())
    }
}

impl candle_core::CustomOp2 for GenericOp {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.forward(cpu)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.forward(cuda)
    }

    fn bwd(
        &self,
        x1: &Tensor,
        x2: &Tensor,
        y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut grads = self.grads(&[x1, x2], y, g)?.into_iter();
        Ok((grads.next().flatten(), grads.next().flatten()))
    }
}

impl candle_core::CustomOp3 for GenericOp {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.forward(cpu)
    }

    #[cfg(feature = "cuda")]
    // candle's `CustomOp3::cuda_fwd`: three storages, each with its layout.
    #[allow(clippy::too_many_arguments)]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.forward(cuda)
    }

    fn bwd(
        &self,
        x1: &Tensor,
        x2: &Tensor,
        x3: &Tensor,
        y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut grads = self.grads(&[x1, x2, x3], y, g)?.into_iter();
        Ok((grads.next().flatten(), grads.next().flatten(), grads.next().flatten()))
    }
}
