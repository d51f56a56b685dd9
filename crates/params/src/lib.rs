//! `params`: a model's named parameters and what is saved of them.
//!
//! - [`ParamStore`] holds the parameters and buffers of a model under the names published
//!   checkpoints use (Hugging Face, torchvision), initialised deterministically from a seed and
//!   the name (candle's CPU RNG cannot be seeded); [`Freeze`] keeps some out of training at no
//!   gradient cost.
//! - Snapshots: [`write_snapshot`] and [`read_snapshot`] write and read safetensors files with a
//!   checksum, replacing the target only once the new file is whole ([`write_atomically`]).
//! - [`lora`]: LoRA adapters as PEFT builds them, beside the parameters they adapt; saved and
//!   loaded in PEFT's layout, merged into the base weights on request.
//! - [`WeightLayout`]: how a linear layer stores its weight, (out, in) or (in, out).
//!
//! Not here: the layers that read the parameters (the `ops` crate), the optimizers that update
//! them (`optim`), the interface a model implements (`trainable`).

mod layout;
pub mod lora;
mod store;

pub use layout::WeightLayout;
pub use store::{
    all_finite, f32_bits, is_index, partial_path, read_snapshot, shards, write_atomically,
    write_snapshot, Freeze, Init, Initialised, ParamStore, Snapshot, SnapshotError,
};
