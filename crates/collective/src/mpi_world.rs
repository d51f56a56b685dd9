//! The MPI world, served by one thread that alone calls MPI (it initialises it, so the
//! `Funneled` thread level suffices): the training thread hands it requests and goes on.

use crate::{CollectiveError, Result};
use mpi::collective::SystemOperation;
use mpi::traits::*;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::time::{Duration, Instant};

/// Floats per all-reduce call (16 MiB).
const CHUNK: usize = 1 << 22;
/// Bytes per broadcast or send (16 MiB: MPI counts in `int`).
const BYTE_CHUNK: usize = 1 << 24;

enum Request {
    Sum(Vec<f32>),
    MinMax(u64),
    /// The root's bytes into every rank's buffer (of the root's length).
    Broadcast(Vec<u8>, usize),
    /// Every rank's bytes to rank 0.
    Gather(Vec<u8>),
    Abort(i32),
}

enum Reply {
    Sum(Vec<f32>, Duration),
    MinMax(u64, u64),
    Bytes(Vec<u8>),
    Gathered(Option<Vec<Vec<u8>>>),
}

pub(crate) struct MpiWorld {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    requests: Option<Sender<Request>>,
    replies: Receiver<Reply>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MpiWorld {
    pub(crate) fn start() -> Result<Self> {
        let (requests, inbox) = channel::<Request>();
        let (outbox, replies) = channel::<Reply>();
        let (ready, started) = channel::<std::result::Result<(usize, usize), String>>();
        let thread = std::thread::Builder::new()
            .name("mpi".into())
            .spawn(move || {
                let Some((universe, _)) = mpi::initialize_with_threading(mpi::Threading::Funneled)
                else {
                    let _ = ready.send(Err("MPI was already initialised".into()));
                    return;
                };
                let world = universe.world();
                let _ = ready.send(Ok((world.rank() as usize, world.size() as usize)));
                for request in inbox {
                    let reply = match request {
                        Request::Sum(mut values) => {
                            // In place, a chunk at a time: a second buffer of the whole size
                            // would hold every gradient twice.
                            let clock = Instant::now();
                            let mut sum = vec![0f32; CHUNK.min(values.len())];
                            for chunk in values.chunks_mut(CHUNK) {
                                let sum = &mut sum[..chunk.len()];
                                world.all_reduce_into(
                                    &chunk[..],
                                    &mut sum[..],
                                    SystemOperation::sum(),
                                );
                                chunk.copy_from_slice(sum);
                            }
                            Reply::Sum(values, clock.elapsed())
                        }
                        Request::MinMax(v) => {
                            let (mut min, mut max) = (0u64, 0u64);
                            world.all_reduce_into(&v, &mut min, SystemOperation::min());
                            world.all_reduce_into(&v, &mut max, SystemOperation::max());
                            Reply::MinMax(min, max)
                        }
                        Request::Broadcast(mut bytes, root) => {
                            let root = world.process_at_rank(root as i32);
                            bytes
                                .chunks_mut(BYTE_CHUNK)
                                .for_each(|chunk| root.broadcast_into(chunk));
                            Reply::Bytes(bytes)
                        }
                        Request::Gather(bytes) => Reply::Gathered(gather(&world, bytes)),
                        Request::Abort(code) => world.abort(code),
                    };
                    if outbox.send(reply).is_err() {
                        break;
                    }
                }
                // `universe` drops here: MPI_Finalize, on the thread that initialised MPI.
            })
            .map_err(|e| CollectiveError::Mpi(format!("cannot start the MPI thread: {e}")))?;
        let (rank, size) =
            started.recv().map_err(|_| CollectiveError::Gone)?.map_err(CollectiveError::Mpi)?;
        Ok(MpiWorld { rank, size, requests: Some(requests), replies, thread: Some(thread) })
    }

    fn send(&self, request: Request) -> Result<()> {
        self.requests
            .as_ref()
            .expect("open until drop")
            .send(request)
            .map_err(|_| CollectiveError::Gone)
    }

    pub(crate) fn send_sum(&self, local: Vec<f32>) -> Result<()> {
        self.send(Request::Sum(local))
    }

    fn reply(&self) -> Result<Reply> {
        self.replies.recv().map_err(|_| CollectiveError::Gone)
    }

    pub(crate) fn receive_sum(&self) -> Result<(Vec<f32>, Duration)> {
        match self.reply()? {
            Reply::Sum(sum, busy) => Ok((sum, busy)),
            _ => Err(out_of_order()),
        }
    }

    /// The least and the greatest `value` over the ranks. Call with no sum in flight.
    pub(crate) fn min_max(&self, value: u64) -> Result<(u64, u64)> {
        self.send(Request::MinMax(value))?;
        match self.reply()? {
            Reply::MinMax(min, max) => Ok((min, max)),
            _ => Err(out_of_order()),
        }
    }

    /// `bytes` of rank `root` on every rank (the others pass a buffer of that length). Call with
    /// no sum in flight.
    pub(crate) fn broadcast(&self, bytes: Vec<u8>, root: usize) -> Result<Vec<u8>> {
        self.send(Request::Broadcast(bytes, root))?;
        match self.reply()? {
            Reply::Bytes(bytes) => Ok(bytes),
            _ => Err(out_of_order()),
        }
    }

    /// Every rank's `bytes` on rank 0, in rank order; `None` elsewhere. Call with no sum in flight.
    pub(crate) fn gather(&self, bytes: Vec<u8>) -> Result<Option<Vec<Vec<u8>>>> {
        self.send(Request::Gather(bytes))?;
        match self.reply()? {
            Reply::Gathered(all) => Ok(all),
            _ => Err(out_of_order()),
        }
    }

    pub(crate) fn abort(&self, code: i32) -> ! {
        let _ = self.send(Request::Abort(code));
        // MPI_Abort ends this process too; should the thread be gone, end it here.
        std::thread::sleep(Duration::from_secs(10));
        std::process::exit(code)
    }
}

fn out_of_order() -> CollectiveError {
    CollectiveError::Mpi("replies out of order: a call was made while a sum was in flight".into())
}

/// Rank 0 receives every other rank's bytes (their length, then the bytes a chunk at a time);
/// the others send theirs.
fn gather(world: &mpi::topology::SimpleCommunicator, bytes: Vec<u8>) -> Option<Vec<Vec<u8>>> {
    if world.rank() != 0 {
        let root = world.process_at_rank(0);
        root.send(&(bytes.len() as u64));
        bytes.chunks(BYTE_CHUNK).for_each(|chunk| root.send(chunk));
        return None;
    }
    let mut all = vec![bytes];
    for rank in 1..world.size() {
        let from = world.process_at_rank(rank);
        let (len, _) = from.receive::<u64>();
        let mut bytes = vec![0u8; len as usize];
        bytes.chunks_mut(BYTE_CHUNK).for_each(|chunk| {
            from.receive_into(chunk);
        });
        all.push(bytes);
    }
    Some(all)
}

impl Drop for MpiWorld {
    fn drop(&mut self) {
        self.requests.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
