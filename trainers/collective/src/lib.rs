//! `collective`: the ranks of a data-parallel run and what they say to each other.
//!
//! A [`Group`] is this process's place among the ranks: one rank by default; under `mpirun`
//! (feature `mpi`), the MPI world. Its one job in training is summing gradients across ranks
//! ([`Group::start_sum`], [`Group::wait_sum`]): a sum started while the executor recomputes an
//! earlier segment runs meanwhile, on a thread of its own that alone makes MPI calls. It also
//! shards a batch ([`Group::shard`]), checks that every rank holds the same bits
//! ([`Group::same_everywhere`]) and ends all ranks when one fails ([`Group::abort`]).
//!
//! Not here: the training loop (`trainkit`), launching processes (`mpirun`), the model.

use candle_core::{DType, Device, Shape, Tensor};
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::time::Duration;

#[cfg(feature = "mpi")]
mod mpi_world;

#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("launched by {launcher} as one of {world} ranks, but this binary was built without the `{feature}` feature (cargo build --features {feature})")]
    NotBuiltFor { launcher: &'static str, world: usize, feature: &'static str },
    #[error("MPI: {0}")]
    Mpi(String),
    #[error("the communication thread ended (another rank failed?)")]
    Gone,
    #[error("wait_sum without a sum started")]
    NothingStarted,
}

pub type Result<T> = std::result::Result<T, CollectiveError>;

/// Time spent communicating, summed over a run.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommTime {
    /// In all-reduce calls (on the communication thread, overlapping the computation).
    pub all_reduce: Duration,
    /// Of it, what the training thread waited for: the part the computation did not hide.
    pub waited: Duration,
    /// Floats summed.
    pub floats: u64,
}

/// A sum in flight: where its tensors go back; one rank's sum is its own input.
struct Pending {
    shapes: Vec<(Shape, Device)>,
    local: Option<Vec<f32>>,
}

/// This process's place among the ranks of a run.
pub struct Group {
    rank: usize,
    world: usize,
    #[cfg(feature = "mpi")]
    mpi: Option<mpi_world::MpiWorld>,
    pending: RefCell<VecDeque<Pending>>,
    time: Cell<CommTime>,
}

/// The environment variables launchers set: (launcher, world size, rank).
fn launched() -> Option<(&'static str, usize, usize)> {
    let var = |name: &str| std::env::var(name).ok()?.parse::<usize>().ok();
    for (launcher, size, rank) in [("mpirun", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"), ("an MPI launcher", "PMI_SIZE", "PMI_RANK")] {
        if let (Some(world), Some(rank)) = (var(size), var(rank)) {
            return Some((launcher, world, rank));
        }
    }
    None
}

impl Group {
    /// One rank: nothing to communicate.
    pub fn single() -> Self {
        Group {
            rank: 0,
            world: 1,
            #[cfg(feature = "mpi")]
            mpi: None,
            pending: RefCell::new(VecDeque::new()),
            time: Cell::new(CommTime::default()),
        }
    }

    /// The ranks this process was launched among: the MPI world under `mpirun -np N` (N > 1),
    /// else one rank. A launch this binary cannot serve (no `mpi` feature) is an error, not N
    /// independent runs.
    pub fn from_launcher() -> Result<Self> {
        match launched() {
            None | Some((_, 1, _)) => Ok(Self::single()),
            #[cfg(feature = "mpi")]
            Some(_) => {
                let world = mpi_world::MpiWorld::start()?;
                Ok(Group { rank: world.rank, world: world.size, mpi: Some(world), ..Self::single() })
            }
            #[cfg(not(feature = "mpi"))]
            Some((launcher, world, _)) => Err(CollectiveError::NotBuiltFor { launcher, world, feature: "mpi" }),
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
                    candle_core::bail!("a batch input of {n} rows does not split into {} ranks", self.world)
                }
                let part = n / self.world;
                t.narrow(0, self.rank * part, part)?.contiguous()
            })
            .collect::<candle_core::Result<_>>()
            .map_err(Into::into)
    }

    /// Starts summing `tensors` across the ranks (as f32), to be collected by [`Group::wait_sum`]
    /// in the order started; every rank must start the same sums in the same order. Returns at
    /// once: the sum runs while the caller computes.
    pub fn start_sum(&self, tensors: &[Tensor]) -> Result<()> {
        let shapes = tensors.iter().map(|t| (t.shape().clone(), t.device().clone())).collect();
        let mut flat = Vec::with_capacity(tensors.iter().map(Tensor::elem_count).sum());
        for t in tensors {
            flat.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        }
        let mut time = self.time.get();
        time.floats += flat.len() as u64;
        self.time.set(time);
        let local = match self.mpi() {
            Some(world) => {
                world.send_sum(flat)?;
                None
            }
            None => Some(flat),
        };
        self.pending.borrow_mut().push_back(Pending { shapes, local });
        Ok(())
    }

    /// The oldest sum started: the tensors' sums over the ranks, f32, in their shapes and devices.
    pub fn wait_sum(&self) -> Result<Vec<Tensor>> {
        let pending = self.pending.borrow_mut().pop_front().ok_or(CollectiveError::NothingStarted)?;
        let clock = std::time::Instant::now();
        let (flat, busy) = match (pending.local, self.mpi()) {
            (Some(flat), _) => (flat, Duration::ZERO),
            (None, Some(world)) => world.receive_sum()?,
            (None, None) => unreachable!("a sum without a local result is an MPI one"),
        };
        let mut time = self.time.get();
        time.waited += clock.elapsed();
        time.all_reduce += busy;
        self.time.set(time);
        let mut at = 0;
        pending
            .shapes
            .into_iter()
            .map(|(shape, device)| {
                let n = shape.elem_count();
                at += n;
                Ok(Tensor::from_slice(&flat[at - n..at], shape, &device)?)
            })
            .collect()
    }

    /// The least and the greatest `value` over the ranks (per-rank peaks). Call between sums.
    pub fn min_max(&self, value: u64) -> Result<(u64, u64)> {
        match self.mpi() {
            Some(world) => world.min_max(value),
            None => Ok((value, value)),
        }
    }

    /// Whether every rank passed the same `value` (a hash of the parameters: ranks in sync).
    pub fn same_everywhere(&self, value: u64) -> Result<bool> {
        let (min, max) = self.min_max(value)?;
        Ok(min == max)
    }

    /// Ends every rank's process (MPI_Abort) after this one failed: without it the others would
    /// wait for it in their next sum. One rank: exits.
    pub fn abort(&self, code: i32) -> ! {
        if let Some(world) = self.mpi() {
            world.abort(code);
        }
        std::process::exit(code)
    }

    #[cfg(feature = "mpi")]
    fn mpi(&self) -> Option<&mpi_world::MpiWorld> {
        self.mpi.as_ref()
    }

    #[cfg(not(feature = "mpi"))]
    fn mpi(&self) -> Option<&NoMpi> {
        None
    }
}

/// Stands in for the MPI world in a build without it: never constructed.
#[cfg(not(feature = "mpi"))]
enum NoMpi {}

#[cfg(not(feature = "mpi"))]
impl NoMpi {
    fn send_sum(&self, _: Vec<f32>) -> Result<()> {
        match *self {}
    }
    fn receive_sum(&self) -> Result<(Vec<f32>, Duration)> {
        match *self {}
    }
    fn min_max(&self, _: u64) -> Result<(u64, u64)> {
        match *self {}
    }
    fn abort(&self, _: i32) -> ! {
        match *self {}
    }
}
