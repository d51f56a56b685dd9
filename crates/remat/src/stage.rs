//! The unit the executor schedules: a stage, and the context it runs in.

use crate::rng::RngKey;
use candle_core::Tensor;
use std::cell::Cell;

/// What a stage is to the policies: `sqrt` and `every-n` count blocks, `before-downsample` stores
/// the input of every downsampling stage; other stages (stems, heads) are not counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StageKind {
    Block,
    /// A block that reduces the spatial size (a residual block with a stride-2 conv).
    DownsampleBlock,
    /// A stage that only reduces the spatial size (pooling): not counted as a block.
    Downsample,
    Other,
}

impl StageKind {
    pub fn is_block(self) -> bool {
        matches!(self, StageKind::Block | StageKind::DownsampleBlock)
    }

    pub fn is_downsample(self) -> bool {
        matches!(self, StageKind::DownsampleBlock | StageKind::Downsample)
    }
}

/// One node of a [`crate::StageGraph`]: a differentiable function of several tensors.
///
/// A stage must be a pure function of its inputs, its parameters and the random draws it takes
/// from `ctx`: the executor may run it twice (forward, then recompute) and relies on both runs
/// giving bit-identical results.
pub trait Stage {
    fn name(&self) -> String;
    fn kind(&self) -> StageKind {
        StageKind::Block
    }
    fn forward(&self, inputs: &[Tensor], ctx: &StageCtx) -> candle_core::Result<Vec<Tensor>>;
    /// What makes two stages alike to the planner: stages with equal signatures, given inputs of
    /// equal shapes and dtypes, allocate the same bytes, take the same time and have parameters
    /// of the same shapes that no other stage reads (the blocks of a transformer). The planner
    /// measures the first of them and reuses its costs for the others
    /// ([`crate::plan::Profile::measure`]). `None`, the default: measured on its own.
    fn signature(&self) -> Option<String> {
        None
    }
}

/// What a stage may know about the run it is part of.
#[derive(Debug)]
pub struct StageCtx {
    key: RngKey,
    calls: Cell<u64>,
    recompute: bool,
    train: bool,
}

impl StageCtx {
    pub fn new(seed: u64, step: u64, stage: usize, pass: u64, recompute: bool, train: bool) -> Self {
        let key = RngKey { seed, step, stage: stage as u64, call: 0, pass };
        StageCtx { key, calls: Cell::new(0), recompute, train }
    }

    /// A context for evaluation outside the executor: no dropout, no recompute.
    pub fn eval() -> Self {
        Self::new(0, 0, 0, 0, false, false)
    }

    /// The key for this stage's next random draw. Call sites draw in program order, so the n-th
    /// draw of a recompute gets the same key as the n-th draw of the forward pass.
    pub fn next_key(&self) -> RngKey {
        let call = self.calls.get();
        self.calls.set(call + 1);
        RngKey { call, ..self.key }
    }

    /// True while the executor recomputes the stage for backward: side effects that must happen
    /// once per step (BatchNorm running statistics) are skipped.
    pub fn is_recompute(&self) -> bool {
        self.recompute
    }

    /// Training mode: dropout active, BatchNorm uses batch statistics.
    pub fn is_training(&self) -> bool {
        self.train
    }
}

/// A stage behind a pointer is a stage: `Arc` lets a model keep typed handles to its stages while
/// the graph owns them too; `Box<dyn Stage>` lets a list of different stages become a chain.
macro_rules! forward_stage {
    ($ptr:ident) => {
        impl<S: Stage + ?Sized> Stage for $ptr<S> {
            fn name(&self) -> String {
                (**self).name()
            }
            fn kind(&self) -> StageKind {
                (**self).kind()
            }
            fn forward(&self, inputs: &[Tensor], ctx: &StageCtx) -> candle_core::Result<Vec<Tensor>> {
                (**self).forward(inputs, ctx)
            }
            fn signature(&self) -> Option<String> {
                (**self).signature()
            }
        }
    };
}
use std::sync::Arc;
forward_stage!(Arc);
forward_stage!(Box);

/// A candle [`Module`](candle_core::Module) as a block stage, in one line: `remat::module("fc1",
/// layer)`. The module must be deterministic (no dropout of its own: use [`from_fn`] with the
/// keys of `ctx` for that).
pub fn module<M: candle_core::Module + 'static>(name: &str, m: M) -> impl Stage {
    Module { name: name.to_string(), m }
}

struct Module<M> {
    name: String,
    m: M,
}

impl<M: candle_core::Module> Stage for Module<M> {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn forward(&self, inputs: &[Tensor], _: &StageCtx) -> candle_core::Result<Vec<Tensor>> {
        Ok(vec![self.m.forward(&inputs[0])?])
    }
}

/// A closure of the stage's inputs and context as a stage of `kind`: `remat::from_fn("head",
/// StageKind::Other, |x, ctx| ...)`. Random draws must come from `ctx.next_key()`.
pub fn from_fn<F>(name: &str, kind: StageKind, f: F) -> impl Stage
where
    F: Fn(&[Tensor], &StageCtx) -> candle_core::Result<Tensor> + 'static,
{
    FnStage { name: name.to_string(), kind, f }
}

struct FnStage<F> {
    name: String,
    kind: StageKind,
    f: F,
}

impl<F: Fn(&[Tensor], &StageCtx) -> candle_core::Result<Tensor>> Stage for FnStage<F> {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn kind(&self) -> StageKind {
        self.kind
    }
    fn forward(&self, inputs: &[Tensor], ctx: &StageCtx) -> candle_core::Result<Vec<Tensor>> {
        Ok(vec![(self.f)(inputs, ctx)?])
    }
}
