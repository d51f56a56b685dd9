//! NCCL between GPUs, one process per GPU: sums run on device tensors (no copy to the host),
//! queued on the device's stream after the kernels that made them, so the host goes on at once.
//! Ranks find each other through a file: rank 0 writes NCCL's unique id, the others read it.

use crate::{CollectiveError, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::nccl::{Comm, Id, ReduceOp};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A communicator that candle's custom ops (which must be `Send + Sync`) can hold.
struct Handle(Comm);

// SAFETY: NCCL forbids concurrent calls on one communicator from several threads. Only the
// training thread calls it: a `Group` is neither shared nor sent, and candle runs a custom op
// on the thread that applies it.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

pub(crate) struct NcclWorld {
    comm: Arc<Handle>,
    pub(crate) rank: usize,
    pub(crate) size: usize,
}

fn nccl_error(what: &str, e: impl std::fmt::Debug) -> CollectiveError {
    CollectiveError::Nccl(format!("{what}: {e:?}"))
}

impl NcclWorld {
    /// Joins the `size` ranks on `device` (a CUDA device), meeting through `id_file`.
    pub(crate) fn start(device: &Device, rank: usize, size: usize, id_file: &Path) -> Result<Self> {
        let id = if rank == 0 {
            let id = Id::new().map_err(|e| nccl_error("ncclGetUniqueId", e))?;
            let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
            let partial = id_file.with_extension("partial");
            std::fs::write(&partial, bytes).and_then(|()| std::fs::rename(&partial, id_file)).map_err(|e| nccl_error("writing the id file", e))?;
            id
        } else {
            let clock = Instant::now();
            let bytes = loop {
                match std::fs::read(id_file) {
                    Ok(b) if b.len() == 128 => break b,
                    _ if clock.elapsed() > Duration::from_secs(120) => {
                        return Err(CollectiveError::Nccl(format!("rank 0 wrote no id to {} in 120 s", id_file.display())))
                    }
                    _ => std::thread::sleep(Duration::from_millis(50)),
                }
            };
            let mut internal = [0 as std::ffi::c_char; 128];
            internal.iter_mut().zip(&bytes).for_each(|(c, &b)| *c = b as std::ffi::c_char);
            Id::uninit(internal)
        };
        let stream = device.as_cuda_device()?.cuda_stream();
        let comm = Comm::from_rank(stream, rank, size, id).map_err(|e| nccl_error("ncclCommInitRank", e.0))?;
        Ok(NcclWorld { comm: Arc::new(Handle(comm)), rank, size })
    }

    /// `t` summed over the ranks, in f32, on the device; queued, not waited for.
    pub(crate) fn sum(&self, t: &Tensor) -> Result<Tensor> {
        let t = t.to_dtype(DType::F32)?.contiguous()?;
        Ok(t.apply_op1_no_bwd(&AllReduce { comm: self.comm.clone(), op: Op::Sum })?)
    }

    pub(crate) fn min_max(&self, value: u64, device: &Device) -> Result<(u64, u64)> {
        // Two's complement keeps equality, and per-rank peaks are far below 2^63.
        let t = Tensor::new(&[value as i64], device)?;
        let reduce = |op| -> Result<u64> { Ok(t.apply_op1_no_bwd(&AllReduce { comm: self.comm.clone(), op })?.to_vec1::<i64>()?[0] as u64) };
        Ok((reduce(Op::Min)?, reduce(Op::Max)?))
    }
}

#[derive(Clone, Copy)]
enum Op {
    Sum,
    Min,
    Max,
}

struct AllReduce {
    comm: Arc<Handle>,
    op: Op,
}

impl CustomOp1 for AllReduce {
    fn name(&self) -> &'static str {
        "nccl-all-reduce"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("NCCL sums CUDA tensors only")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let Some((start, end)) = l.contiguous_offsets() else { candle_core::bail!("nccl-all-reduce: the tensor must be contiguous") };
        let op = match self.op {
            Op::Sum => ReduceOp::Sum,
            Op::Min => ReduceOp::Min,
            Op::Max => ReduceOp::Max,
        };
        let dev = s.device().clone();
        let failed = |e: candle_core::cuda::cudarc::nccl::result::NcclError| candle_core::Error::Msg(format!("ncclAllReduce: {e:?}"));
        let out = match s.dtype() {
            DType::F32 => {
                let src = s.as_cuda_slice::<f32>()?.slice(start..end);
                let mut dst = dev.alloc_zeros::<f32>(end - start)?;
                self.comm.0.all_reduce(&src, &mut dst, &op).map_err(failed)?;
                CudaStorage::wrap_cuda_slice(dst, dev)
            }
            DType::I64 => {
                let src = s.as_cuda_slice::<i64>()?.slice(start..end);
                let mut dst = dev.alloc_zeros::<i64>(end - start)?;
                self.comm.0.all_reduce(&src, &mut dst, &op).map_err(failed)?;
                CudaStorage::wrap_cuda_slice(dst, dev)
            }
            other => candle_core::bail!("nccl-all-reduce: {other:?} is not summed here (f32, i64)"),
        };
        Ok((out, l.shape().clone()))
    }
}
