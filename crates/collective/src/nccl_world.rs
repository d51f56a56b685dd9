//! NCCL between GPUs, one process per GPU: sums run on device tensors (no copy to the host),
//! queued on the device's stream after the kernels that made them, so the host goes on at once.
//! Ranks find each other through a file: rank 0 writes NCCL's unique id, the others read it.

use crate::{CollectiveError, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use candle_core::cuda::cudarc::nccl::{Comm, Id, NcclType, ReduceOp};
use candle_core::cuda::CudaDType;
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
// SAFETY: as for `Send`: shared references to it are used on the training thread alone.
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
            std::fs::write(&partial, bytes)
                .and_then(|()| std::fs::rename(&partial, id_file))
                .map_err(|e| nccl_error("writing the id file", e))?;
            id
        } else {
            let clock = Instant::now();
            let bytes = loop {
                match std::fs::read(id_file) {
                    Ok(b) if b.len() == 128 => break b,
                    _ if clock.elapsed() > Duration::from_secs(120) => {
                        return Err(CollectiveError::Nccl(format!(
                            "rank 0 wrote no id to {} in 120 s",
                            id_file.display()
                        )))
                    }
                    _ => std::thread::sleep(Duration::from_millis(50)),
                }
            };
            let mut internal = [0 as std::ffi::c_char; 128];
            internal.iter_mut().zip(&bytes).for_each(|(c, &b)| *c = b as std::ffi::c_char);
            Id::uninit(internal)
        };
        let stream = device.as_cuda_device()?.cuda_stream();
        let comm = Comm::from_rank(stream, rank, size, id)
            .map_err(|e| nccl_error("ncclCommInitRank", e.0))?;
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
        let reduce = |op| -> Result<u64> {
            Ok(t.apply_op1_no_bwd(&AllReduce { comm: self.comm.clone(), op })?.to_vec1::<i64>()?[0]
                as u64)
        };
        Ok((reduce(Op::Min)?, reduce(Op::Max)?))
    }

    /// `t` as rank `root` holds it, on every rank (in `t`'s dtype: NCCL moves the bits).
    pub(crate) fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        Ok(t.contiguous()?.apply_op1_no_bwd(&Broadcast {
            comm: self.comm.clone(),
            root,
            rank: self.rank,
        })?)
    }

    /// Every rank's `bytes` on rank 0 (through the GPU: NCCL's send and receive), its own first.
    pub(crate) fn gather(&self, bytes: Vec<u8>, device: &Device) -> Result<Option<Vec<Vec<u8>>>> {
        let send = |bytes: Vec<u8>| -> Result<()> {
            let n = bytes.len();
            Tensor::from_vec(bytes, n, device)?.apply_op1_no_bwd(&PointToPoint {
                comm: self.comm.clone(),
                peer: 0,
                receive: None,
            })?;
            Ok(())
        };
        let receive = |len: usize, peer: usize| -> Result<Vec<u8>> {
            let any = Tensor::zeros(1, DType::U8, device)?;
            Ok(any
                .apply_op1_no_bwd(&PointToPoint {
                    comm: self.comm.clone(),
                    peer,
                    receive: Some(len),
                })?
                .to_vec1::<u8>()?)
        };
        if self.rank != 0 {
            send((bytes.len() as u64).to_le_bytes().to_vec())?;
            send(bytes)?;
            return Ok(None);
        }
        let mut all = vec![bytes];
        for peer in 1..self.size {
            let len = u64::from_le_bytes(receive(8, peer)?.try_into().expect("8 bytes"));
            all.push(receive(len as usize, peer)?);
        }
        Ok(Some(all))
    }
}

/// NCCL's broadcast from `root`, out of place.
struct Broadcast {
    comm: Arc<Handle>,
    root: usize,
    rank: usize,
}

impl Broadcast {
    fn run<T: CudaDType + NcclType + DeviceRepr + ValidAsZeroBits>(
        &self,
        s: &CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<CudaStorage> {
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("nccl-broadcast: the tensor must be contiguous")
        };
        let dev = s.device().clone();
        let src = s.as_cuda_slice::<T>()?.slice(start..end);
        let mut dst = dev.alloc_zeros::<T>(end - start)?;
        let send = (self.rank == self.root).then_some(&src);
        self.comm
            .0
            .broadcast(send, &mut dst, self.root as i32)
            .map_err(|e| candle_core::Error::Msg(format!("ncclBroadcast: {e:?}")))?;
        Ok(CudaStorage::wrap_cuda_slice(dst, dev))
    }
}

impl CustomOp1 for Broadcast {
    fn name(&self) -> &'static str {
        "nccl-broadcast"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("NCCL broadcasts CUDA tensors only")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let out = match s.dtype() {
            DType::F32 => self.run::<f32>(s, l)?,
            DType::BF16 => self.run::<half::bf16>(s, l)?,
            DType::F16 => self.run::<half::f16>(s, l)?,
            DType::F64 => self.run::<f64>(s, l)?,
            DType::I64 => self.run::<i64>(s, l)?,
            DType::U8 => self.run::<u8>(s, l)?,
            other => candle_core::bail!("nccl-broadcast: {other:?} is not broadcast here"),
        };
        Ok((out, l.shape().clone()))
    }
}

/// Sends the bytes of a U8 tensor to `peer` (the result is a byte of nothing), or with
/// `receive: Some(len)`, returns `len` bytes received from `peer`.
struct PointToPoint {
    comm: Arc<Handle>,
    peer: usize,
    receive: Option<usize>,
}

impl CustomOp1 for PointToPoint {
    fn name(&self) -> &'static str {
        "nccl-send-receive"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("NCCL sends CUDA tensors only")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = s.device().clone();
        let failed = |e: candle_core::cuda::cudarc::nccl::result::NcclError| {
            candle_core::Error::Msg(format!("ncclSend/ncclRecv: {e:?}"))
        };
        if let Some(len) = self.receive {
            let mut dst = dev.alloc_zeros::<u8>(len)?;
            self.comm.0.recv(&mut dst, self.peer as i32).map_err(failed)?;
            return Ok((CudaStorage::wrap_cuda_slice(dst, dev), Shape::from(len)));
        }
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("nccl-send: the tensor must be contiguous")
        };
        self.comm
            .0
            .send(&s.as_cuda_slice::<u8>()?.slice(start..end), self.peer as i32)
            .map_err(failed)?;
        Ok((CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<u8>(1)?, dev), Shape::from(1)))
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
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("nccl-all-reduce: the tensor must be contiguous")
        };
        let op = match self.op {
            Op::Sum => ReduceOp::Sum,
            Op::Min => ReduceOp::Min,
            Op::Max => ReduceOp::Max,
        };
        let dev = s.device().clone();
        let failed = |e: candle_core::cuda::cudarc::nccl::result::NcclError| {
            candle_core::Error::Msg(format!("ncclAllReduce: {e:?}"))
        };
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
