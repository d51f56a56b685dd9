//! The device-generic route of the fused ops: an op's forward and backward composed from candle's
//! own tensor ops on detached operands, recorded as one custom op over the operands, so nothing of
//! the composition enters candle's graph and the op keeps for backward what its CPU kernel keeps
//! (its operands and its output). The price is one copy of the output: candle makes a custom op's
//! output from the storage its forward returns. CUDA tensors take this route; `set_path` forces
//! it on the CPU, so that what it keeps can be measured without a GPU. Not here: which route an
//! op takes (`route`), the CPU kernels (each op's own module).

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, Layout, Result, Shape, Storage, Tensor};
use std::sync::Mutex;

/// The gradients of an op's operands from its detached operands, output and output gradient,
/// and which operands want one (some variable leads to them: not a frozen weight, not an image).
type Backward =
    dyn Fn(&[Tensor], &Tensor, &Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync;

/// A composed forward's result recorded as one op over its operands, with its composed backward.
pub(crate) struct GenericOp {
    name: &'static str,
    /// Taken by the forward: the op does not hold a second copy of its output.
    out: Mutex<Option<Tensor>>,
    backward: Box<Backward>,
}

impl GenericOp {
    pub(crate) fn new(name: &'static str, out: Tensor, backward: Box<Backward>) -> Self {
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
pub(crate) fn copied<S>(
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

/// The storage `s` as a CPU one, if it is: the pick of an output given on the CPU.
pub(crate) fn cpu(s: &Storage) -> Option<&CpuStorage> {
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
