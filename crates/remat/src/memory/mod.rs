//! The memory meter: exact heap bytes on the CPU, a GPU's memory pool, the process's peak RSS,
//! and a per-step timeline.
//!
//! Heap figures come from [`CountingAlloc`] (feature `meter`), a global allocator that counts
//! every byte it hands out. A binary or test installs it with
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOC: remat::memory::CountingAlloc = remat::memory::CountingAlloc;
//! ```
//!
//! The parts, one file each:
//! - `heap`: the counters the allocator moves, and their readings ([`heap_current`],
//!   [`heap_peak`], [`peak_during`], [`tensor_bytes`]);
//! - `counting`: the allocator itself ([`CountingAlloc`], mimalloc underneath, feature `meter`);
//! - `cap`: the heap cap that emulates a smaller memory ([`set_heap_cap`], [`set_activity`],
//!   [`set_refusal_hint`]);
//! - `process`: what the kernel says ([`rss`], [`minor_faults`]);
//! - `cuda`: a CUDA device's pool (feature `cuda`);
//! - `counter`: the heap or the pool, by device ([`Counter`]);
//! - `meter`: one measured region ([`Meter`], [`Usage`]);
//! - `timeline`: a step stage by stage ([`Timeline`], [`Event`]);
//! - `size`: sizes as text ([`parse_size`], [`format_size`]).
//!
//! Not here: what the planner predicts from these figures ([`crate::plan`]).

mod cap;
mod counter;
#[cfg(feature = "meter")]
mod counting;
#[cfg(feature = "cuda")]
pub mod cuda;
mod heap;
mod meter;
mod process;
mod size;
mod timeline;

pub use cap::{heap_cap, set_activity, set_heap_cap, set_refusal_hint, Activity, CAP_REFUSAL};
pub use counter::Counter;
#[cfg(feature = "meter")]
pub use counting::CountingAlloc;
pub use heap::{
    heap_current, heap_meter_installed, heap_peak, peak_during, reset_heap_peak, tensor_bytes,
    tensor_overhead,
};
pub use meter::{Meter, Usage};
pub use process::{minor_faults, rss};
pub use size::{format_size, gib, mib, parse_size};
pub use timeline::{Event, Phase, Timeline};
