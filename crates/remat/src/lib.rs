//! `remat`: activation (gradient) checkpointing for candle.
//!
//! A model is described as a [`StageGraph`]: stages (usually its blocks) connected by tensor
//! values, as a chain or a DAG with skip edges. A [`Policy`] cuts the stages into contiguous
//! segments; the [`Executor`] runs forward keeping only the values that cross a segment boundary,
//! and runs backward segment by segment, recomputing each from its stored inputs. Gradients are
//! bit-identical to plain candle (`off`), including dropout, because random draws come from
//! counter-based keys ([`rng`]) that are replayed on recompute. A policy may also keep the
//! outputs of named ops inside recomputed segments ([`keep`]: selective recompute), so that a
//! recompute runs only the cheap ops between them.
//!
//! This crate holds the engine only: no model code, no layers (candle-nn's, or a model's own,
//! wrapped as stages), no optimizer. It also owns the memory meter ([`memory`]) that measures what
//! checkpointing buys.
//!
//! It builds against candle-core 0.11 as published. The feature `meter` adds the counting
//! allocator ([`memory`]); `patched-candle` builds over this repository's vendored candle-core,
//! whose variables share a stage input's memory instead of copying it.

#![warn(missing_docs)]

pub mod exec;
pub mod graph;
pub mod keep;
pub mod memory;
pub mod plan;
pub mod policy;
pub mod rng;
pub mod rules;
pub mod signature;
pub mod stage;

pub use exec::{Executor, StepOutput};
pub use graph::{StageGraph, ValueId};
pub use policy::{Policy, PolicyError, PolicyRequest};
pub use signature::Signature;
pub use stage::{from_fn, module, RunMode, RunPoint, Stage, StageCtx, StageKind};

/// Errors of the checkpointing engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An error of candle itself.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A policy that cannot be parsed or does not apply to the graph.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// `budget=`/`auto` found no plan for the graph. `reason` is not a `source`: the message
    /// already includes it, and a chain would print it twice.
    #[allow(missing_docs)] // its fields are what its message names
    #[error("{policy}: {reason}")]
    Plan { policy: String, reason: Box<plan::PlanError> },
    /// A graph that cannot run: a stage reads a value nothing produced, no loss, no stages.
    #[error("stage graph: {0}")]
    Graph(String),
    /// A step or profile given another number of inputs than the graph takes.
    #[allow(missing_docs)] // its fields are what its message names
    #[error("the graph takes {expected} inputs; {got} were given")]
    Inputs { expected: usize, got: usize },
    /// The caller's data (a profile's `inputs_at`) failed.
    #[error("the inputs: {0}")]
    Data(String),
    /// A micro-batch after the first came before the first (its gradients are not empty).
    #[error("accumulate: the first micro-batch must start from empty gradients")]
    FirstMicroBatch,
    /// `auto` with no limit to plan for.
    #[error("`auto` needs a memory limit: a --memory-cap on the CPU, or a GPU's free memory")]
    NoMemoryLimit,
    /// Planning (`budget=`, `auto`, a profile) on the CPU measures the heap through the
    /// counting allocator; without it every figure would read 0.
    #[error(
        "planning on the CPU needs the heap meter: enable remat's `meter` feature and install it \
         with `#[global_allocator] static ALLOC: remat::memory::CountingAlloc = \
         remat::memory::CountingAlloc;`"
    )]
    NoMeter,
    /// Profiles the planner cannot use (two that are not of one graph at two batch sizes).
    #[error(transparent)]
    Profile(#[from] plan::PlanError),
    /// A stage's `forward` failed (or returned another number of outputs than the graph wires).
    #[allow(missing_docs)] // its fields are what its message names
    #[error("stage {stage} (`{name}`): {source}")]
    Stage { stage: usize, name: String, source: candle_core::Error },
    /// A `+keep=` policy whose recomputed segments run no op of the kinds it keeps.
    #[error(
        "+keep={keep} keeps nothing in this graph: its recomputed segments run no {keep} op \
         through `remat::keep::op` (the keepable ops they run: {}). Run the ops to keep through \
         `remat::keep::op` (candle's and candle-nn's own ops, a `Linear` included, do not: an op \
         is keepable only where its code calls it), or leave +keep= out",
        if seen.is_empty() { "none" } else { seen.as_str() }
    )]
    #[allow(missing_docs)] // its fields are what its message names
    KeepsNothing { keep: String, seen: String },
    /// A recomputed stage gave other outputs than its forward: its gradients would be wrong.
    #[error(
        "stage {stage} (`{name}`): its recompute gave another output {output} than its forward, so \
         its gradients would be wrong. The stage draws randomness that is not from its context \
         (`candle_nn::ops::dropout`, `Tensor::rand`: use `ctx.dropout`, `ctx.next_key()`) or \
         changes state in forward (skip it when `ctx.is_recompute()`). \
         `Executor::without_recompute_check` turns this check off"
    )]
    #[allow(missing_docs)] // its fields are what its message names
    Recompute { stage: usize, name: String, output: usize },
    /// Parameters given to the executor received no gradient in its first step.
    #[error(
        "{count} of the {of} parameters given to the executor received no gradient in the first \
         step: {params}. Training would leave them as they are. The usual causes: an op with no \
         backward in candle 0.11 between them and the loss (`candle_nn::LayerNorm::forward` on a \
         contiguous input: use `candle_nn::ops::layer_norm_slow`; \
         `candle_nn::ops::softmax_last_dim`: use `candle_nn::ops::softmax(x, D::Minus1)`; \
         `candle_nn::ops::rms_norm`), a `detach()`, a parameter no stage reads. Parameters meant \
         to get no gradient: `Executor::frozen`"
    )]
    #[allow(missing_docs)] // its fields are what its message names
    NoGradient { count: usize, of: usize, params: String },
}

/// The engine's result type.
pub type Result<T> = std::result::Result<T, Error>;

/// Model code that builds its graph inside a candle `Result` can use `?` on the engine's errors.
impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        candle_core::Error::wrap(e)
    }
}
