//! `collective`: the ranks of a data-parallel run and what they say to each other.
//!
//! A [`Group`] is this process's place among the ranks: one rank by default; under `mpirun`
//! (feature `mpi`), the MPI world; launched one process per GPU with `RANK`, `WORLD_SIZE` and
//! `NCCL_ID_FILE` set (feature `nccl`), an NCCL communicator. Its one job in training is summing
//! gradients across ranks ([`Group::start_mean`], [`Group::wait_mean`]): a sum started while the
//! executor recomputes an earlier segment runs meanwhile (MPI: on a thread of its own that alone
//! makes MPI calls; NCCL: queued on the GPU's stream). It also shards a batch
//! ([`Group::shard`]), passes one rank's tensor to all ([`Group::broadcast`]) and every rank's
//! bytes to rank 0 ([`Group::gather_bytes`]) (a sharded optimizer's parameters and state),
//! checks that every rank holds the same bits ([`Group::same_everywhere`]) and ends all ranks
//! when one fails ([`Group::abort`]).
//!
//! Not here: the training loop (`trainkit`), launching processes (`mpirun`), the model.

use candle_core::{DType, Device, Tensor};
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::time::Duration;

#[cfg(feature = "mpi")]
mod mpi_world;
#[cfg(feature = "nccl")]
mod nccl_world;

#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(
        "launched by {launcher} as one of {world} ranks, but this binary was built without the \
         `{feature}` feature (cargo build --features {feature})"
    )]
    NotBuiltFor { launcher: &'static str, world: usize, feature: &'static str },
    #[error("MPI: {0}")]
    Mpi(String),
    #[error("NCCL: {0}")]
    Nccl(String),
    #[error("the communication thread ended (another rank failed?)")]
    Gone,
    #[error("there is no rank {rank} among {world}")]
    NoSuchRank { rank: usize, world: usize },
    #[error("wait_mean without a mean started")]
    NothingStarted,
}

pub type Result<T> = std::result::Result<T, CollectiveError>;

/// Time spent communicating, summed over a run.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommTime {
    /// In all-reduce calls (MPI: on the communication thread, overlapping the computation; NCCL:
    /// not measured, the sums run on the GPU).
    pub all_reduce: Duration,
    /// What the training thread waited for the means (dividing by the ranks included): the part
    /// of the communication the computation did not hide.
    pub waited: Duration,
    /// Floats summed.
    pub floats: u64,
}

/// A sum in flight: where its tensors go back.
enum Pending {
    /// One rank: the sum is the input.
    Local(Vec<Tensor>),
    /// MPI: the flat sum comes back from the communication thread.
    #[cfg(feature = "mpi")]
    Host(Vec<(candle_core::Shape, Device)>),
    /// NCCL: the sums, queued on the GPU.
    #[cfg(feature = "nccl")]
    Device(Vec<Tensor>),
}

enum Backend {
    Single,
    #[cfg(feature = "mpi")]
    Mpi(mpi_world::MpiWorld),
    #[cfg(feature = "nccl")]
    Nccl(nccl_world::NcclWorld, Device),
}

/// This process's place among the ranks of a run.
pub struct Group {
    rank: usize,
    world: usize,
    backend: Backend,
    pending: RefCell<VecDeque<Pending>>,
    time: Cell<CommTime>,
}

/// How this process was started among others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Launcher {
    /// `mpirun` or another MPI launcher (its world size and rank variables are set).
    Mpi,
    /// One process per GPU with `RANK` and `WORLD_SIZE` (as `--ranks` on CUDA and torchrun set).
    PerGpu,
}

/// The launcher of this process, its world size and its rank, from the variables launchers set.
fn launched() -> Option<(Launcher, usize, usize)> {
    let var = |name: &str| std::env::var(name).ok()?.parse::<usize>().ok();
    let vars = [
        (Launcher::Mpi, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
        (Launcher::Mpi, "PMI_SIZE", "PMI_RANK"),
        (Launcher::PerGpu, "WORLD_SIZE", "RANK"),
    ];
    vars.into_iter().find_map(|(launcher, size, rank)| Some((launcher, var(size)?, var(rank)?)))
}

impl Group {
    /// One rank: nothing to communicate.
    pub fn single() -> Self {
        Group {
            rank: 0,
            world: 1,
            backend: Backend::Single,
            pending: RefCell::new(VecDeque::new()),
            time: Cell::new(CommTime::default()),
        }
    }

    #[cfg(any(feature = "mpi", feature = "nccl"))]
    fn of(backend: Backend, rank: usize, world: usize) -> Self {
        Group { rank, world, backend, ..Self::single() }
    }

    /// The ranks this process was launched among: the MPI world under `mpirun -np N` (N > 1);
    /// with `RANK` and `WORLD_SIZE` (N > 1) and a CUDA `device`, an NCCL group meeting through
    /// the file `NCCL_ID_FILE`; else one rank. A launch this binary cannot serve (built without
    /// the feature) is an error, not N independent runs.
    pub fn from_launcher(device: &Device) -> Result<Self> {
        let Some((launcher, world, rank)) = launched().filter(|l| l.1 > 1) else {
            return Ok(Self::single());
        };
        match launcher {
            #[cfg(feature = "mpi")]
            Launcher::Mpi => {
                let w = mpi_world::MpiWorld::start()?;
                let (rank, size) = (w.rank, w.size);
                Ok(Self::of(Backend::Mpi(w), rank, size))
            }
            #[cfg(feature = "nccl")]
            Launcher::PerGpu => {
                let id_file = std::env::var_os("NCCL_ID_FILE").ok_or_else(|| {
                    CollectiveError::Nccl(
                        "set NCCL_ID_FILE to a file path every rank can read".into(),
                    )
                })?;
                let w = nccl_world::NcclWorld::start(
                    device,
                    rank,
                    world,
                    std::path::Path::new(&id_file),
                )?;
                let (rank, size) = (w.rank, w.size);
                Ok(Self::of(Backend::Nccl(w, device.clone()), rank, size))
            }
            #[cfg(not(feature = "mpi"))]
            Launcher::Mpi => {
                Err(CollectiveError::NotBuiltFor { launcher: "mpirun", world, feature: "mpi" })
            }
            #[cfg(not(feature = "nccl"))]
            Launcher::PerGpu => {
                let _ = (device, rank); // an NCCL build's
                Err(CollectiveError::NotBuiltFor {
                    launcher: "RANK/WORLD_SIZE",
                    world,
                    feature: "nccl",
                })
            }
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Rank 0 writes logs, snapshots and results.
    pub fn is_root(&self) -> bool {
        self.rank == 0
    }

    pub fn comm_time(&self) -> CommTime {
        self.time.get()
    }

    /// This rank's rows of a global batch: every tensor's first dimension (samples, or samples x
    /// positions for flat targets) cut into `world` equal parts, part `rank` kept. With every
    /// rank drawing the same global batch, the ranks together see exactly it.
    pub fn shard(&self, global: Vec<Tensor>) -> Result<Vec<Tensor>> {
        if self.world == 1 {
            return Ok(global);
        }
        global
            .into_iter()
            .map(|t| {
                let n = t.dim(0)?;
                if n % self.world != 0 {
                    candle_core::bail!(
                        "a batch input of {n} rows does not split into {} ranks",
                        self.world
                    )
                }
                let part = n / self.world;
                t.narrow(0, self.rank * part, part)?.contiguous()
            })
            .collect::<candle_core::Result<_>>()
            .map_err(Into::into)
    }

    /// Starts averaging `tensors` across the ranks (in f32), to be collected by
    /// [`Group::wait_mean`] in the order started; every rank must start the same means in the
    /// same order. Returns at once: the sum runs while the caller computes. The tensors are taken
    /// (MPI copies each into one host buffer and drops it, so a gradient is not held twice).
    pub fn start_mean(&self, tensors: Vec<Tensor>) -> Result<()> {
        let mut time = self.time.get();
        time.floats += tensors.iter().map(|t| t.elem_count() as u64).sum::<u64>();
        self.time.set(time);
        let pending = match &self.backend {
            Backend::Single => Pending::Local(
                tensors
                    .iter()
                    .map(|t| t.to_dtype(DType::F32))
                    .collect::<candle_core::Result<_>>()?,
            ),
            #[cfg(feature = "mpi")]
            Backend::Mpi(world) => {
                let shapes =
                    tensors.iter().map(|t| (t.shape().clone(), t.device().clone())).collect();
                let mut flat = Vec::with_capacity(tensors.iter().map(Tensor::elem_count).sum());
                for t in tensors {
                    flat.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
                }
                world.send_sum(flat)?;
                Pending::Host(shapes)
            }
            #[cfg(feature = "nccl")]
            Backend::Nccl(world, _) => {
                Pending::Device(tensors.iter().map(|t| world.sum(t)).collect::<Result<_>>()?)
            }
        };
        self.pending.borrow_mut().push_back(pending);
        Ok(())
    }

    /// The oldest mean started: the tensors' means over the ranks (sums divided by the ranks, in
    /// f32), in their shapes and devices. MPI's are views into one buffer, which the sum
    /// overwrote in place.
    pub fn wait_mean(&self) -> Result<Vec<Tensor>> {
        let pending =
            self.pending.borrow_mut().pop_front().ok_or(CollectiveError::NothingStarted)?;
        let clock = std::time::Instant::now();
        let (means, busy) = match (pending, &self.backend) {
            (Pending::Local(sums), _) => (sums, Duration::ZERO),
            #[cfg(feature = "nccl")]
            (Pending::Device(sums), _) => (
                sums.iter().map(|s| s / self.world as f64).collect::<candle_core::Result<_>>()?,
                Duration::ZERO,
            ),
            #[cfg(feature = "mpi")]
            (Pending::Host(shapes), Backend::Mpi(world)) => {
                let (mut flat, busy) = world.receive_sum()?;
                let n = self.world as f32;
                flat.iter_mut().for_each(|x| *x /= n);
                let flat = Tensor::from_vec(
                    flat,
                    shapes.iter().map(|(s, _)| s.elem_count()).sum::<usize>(),
                    &Device::Cpu,
                )?;
                let mut at = 0;
                let means = shapes
                    .into_iter()
                    .map(|(shape, device)| {
                        let n = shape.elem_count();
                        at += n;
                        flat.narrow(0, at - n, n)?.reshape(shape)?.to_device(&device)
                    })
                    .collect::<candle_core::Result<_>>()?;
                (means, busy)
            }
            #[cfg(feature = "mpi")]
            (Pending::Host(_), _) => unreachable!("host sums are MPI's"),
        };
        let mut time = self.time.get();
        time.waited += clock.elapsed();
        time.all_reduce += busy;
        self.time.set(time);
        Ok(means)
    }

    /// The mean of `value` over the ranks (a loss), through the same path as the gradients: on
    /// the GPU under NCCL, which sums device tensors only.
    pub fn mean_of(&self, value: f64) -> Result<f64> {
        if self.world == 1 {
            return Ok(value);
        }
        self.start_mean(vec![Tensor::new(&[value as f32], &self.device())?])?;
        Ok(self.wait_mean()?.remove(0).to_vec1::<f32>()?[0] as f64)
    }

    /// Where the group's own small messages live: the GPU under NCCL (which moves device
    /// tensors only), else the CPU.
    fn device(&self) -> Device {
        match &self.backend {
            #[cfg(feature = "nccl")]
            Backend::Nccl(_, device) => device.clone(),
            _ => Device::Cpu,
        }
    }

    /// The least and the greatest `value` over the ranks (per-rank peaks). Call between sums.
    pub fn min_max(&self, value: u64) -> Result<(u64, u64)> {
        match &self.backend {
            Backend::Single => Ok((value, value)),
            #[cfg(feature = "mpi")]
            Backend::Mpi(world) => world.min_max(value),
            #[cfg(feature = "nccl")]
            Backend::Nccl(world, device) => world.min_max(value, device),
        }
    }

    /// Whether every rank passed the same `value` (a hash of the parameters: ranks in sync).
    pub fn same_everywhere(&self, value: u64) -> Result<bool> {
        let (min, max) = self.min_max(value)?;
        Ok(min == max)
    }

    /// `t` as rank `root` holds it, on every rank: the root's bits, in `t`'s shape, dtype and
    /// device (the other ranks pass their own tensor of that shape and dtype, whose values are
    /// replaced). Call with no mean in flight.
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if root >= self.world {
            return Err(CollectiveError::NoSuchRank { rank: root, world: self.world });
        }
        match &self.backend {
            Backend::Single => Ok(t.clone()),
            #[cfg(feature = "mpi")]
            Backend::Mpi(world) => {
                let bytes = if self.rank == root {
                    safetensors::View::data(&t.to_device(&Device::Cpu)?).into_owned()
                } else {
                    vec![0u8; t.elem_count() * t.dtype().size_in_bytes()]
                };
                let bytes = world.broadcast(bytes, root)?;
                if self.rank == root {
                    return Ok(t.clone());
                }
                Ok(Tensor::from_raw_buffer(&bytes, t.dtype(), t.dims(), t.device())?)
            }
            #[cfg(feature = "nccl")]
            Backend::Nccl(world, _) => world.broadcast(t, root),
        }
    }

    /// Rank `root`'s `bytes` on every rank, whatever the others pass (a message: its length
    /// travels first). Call with no mean in flight.
    pub fn broadcast_bytes(&self, bytes: Vec<u8>, root: usize) -> Result<Vec<u8>> {
        if self.world == 1 {
            return Ok(bytes);
        }
        let device = self.device();
        let len = self
            .broadcast(&Tensor::new(&[bytes.len() as i64], &device)?, root)?
            .to_vec1::<i64>()?[0] as usize;
        let bytes = if self.rank == root { bytes } else { vec![0; len] };
        Ok(self.broadcast(&Tensor::from_vec(bytes, len, &device)?, root)?.to_vec1::<u8>()?)
    }

    /// Every rank's `bytes` on rank 0, in rank order (its own first); `None` on the others. Call
    /// with no mean in flight.
    pub fn gather_bytes(&self, bytes: Vec<u8>) -> Result<Option<Vec<Vec<u8>>>> {
        match &self.backend {
            Backend::Single => Ok(Some(vec![bytes])),
            #[cfg(feature = "mpi")]
            Backend::Mpi(world) => world.gather(bytes),
            #[cfg(feature = "nccl")]
            Backend::Nccl(world, device) => world.gather(bytes, device),
        }
    }

    /// Ends every rank's process after this one failed (MPI_Abort; under NCCL the launcher ends
    /// the others): without it the others would wait for this one in their next sum.
    pub fn abort(&self, code: i32) -> ! {
        #[cfg(feature = "mpi")]
        if let Backend::Mpi(world) = &self.backend {
            world.abort(code);
        }
        std::process::exit(code)
    }
}
