//! The unit the executor schedules: a stage, and the context it runs in.

use crate::rng::RngKey;
use crate::signature::Signature;
use candle_core::{DType, Tensor};
use std::cell::Cell;

/// What a stage is to the policies: `sqrt` and `every-n` count blocks, `before-downsample` stores
/// the input of every downsampling stage; other stages (stems, heads) are not counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StageKind {
    /// A block: counted by `sqrt` and `every-n`.
    Block,
    /// A block that reduces the spatial size (a residual block with a stride-2 conv).
    DownsampleBlock,
    /// A stage that only reduces the spatial size (pooling): not counted as a block.
    Downsample,
    /// Anything else (a stem, a head): not counted.
    Other,
}

impl StageKind {
    /// Whether `sqrt` and `every-n` count it.
    pub fn is_block(self) -> bool {
        matches!(self, StageKind::Block | StageKind::DownsampleBlock)
    }

    /// Whether `before-downsample` stores its input.
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
    /// A name for errors and reports (`h.3`, `layer2.1`).
    fn name(&self) -> String;
    /// What the stage is to the policies; a block unless it says otherwise.
    fn kind(&self) -> StageKind {
        StageKind::Block
    }
    /// The stage's outputs from its inputs; random draws from `ctx` only.
    fn forward(&self, inputs: &[Tensor], ctx: &StageCtx) -> candle_core::Result<Vec<Tensor>>;
    /// What makes two stages alike to the planner: stages with equal signatures, given inputs of
    /// equal shapes and dtypes, allocate the same bytes, take the same time and have parameters
    /// of the same shapes that no other stage reads (the blocks of a transformer). The planner
    /// measures the first of them and reuses its costs for the others
    /// ([`crate::plan::Profile::measure`]). `None`, the default: measured on its own.
    fn signature(&self) -> Option<Signature> {
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

/// The parts a [`StageCtx`] is made of: where in training a stage runs, and how.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunPoint {
    /// The run's seed: every random draw of a step derives from it.
    pub seed: u64,
    /// The training step.
    pub step: u64,
    /// The stage's index in its graph.
    pub stage: usize,
    /// 0 for every pass when RNG replay is on; a recompute with replay switched off uses 1.
    pub pass: u64,
    /// Whether this run is the executor's recompute of the stage for backward.
    pub recompute: bool,
    /// Training mode: dropout active, BatchNorm uses batch statistics.
    pub train: bool,
}

impl StageCtx {
    /// The context of a stage run at `at`; `StageCtx::new(RunPoint { seed, step, stage, train:
    /// true, ..Default::default() })` for a training forward outside the executor.
    pub fn new(at: RunPoint) -> Self {
        let key =
            RngKey { seed: at.seed, step: at.step, stage: at.stage as u64, call: 0, pass: at.pass };
        StageCtx { key, calls: Cell::new(0), recompute: at.recompute, train: at.train }
    }

    /// The context of a training forward of stage `stage` at `step`, outside the executor: the
    /// dropout masks the executor's step `step` draws there.
    pub fn train(seed: u64, step: u64, stage: usize) -> Self {
        Self::new(RunPoint { seed, step, stage, train: true, ..RunPoint::default() })
    }

    /// A context for evaluation outside the executor: no dropout, no recompute.
    pub fn eval() -> Self {
        Self::new(RunPoint::default())
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

    /// Inverted dropout of `x` with drop probability `p` in training mode (`x` unchanged in
    /// evaluation or for `p == 0`), its mask drawn from the key [`StageCtx::dropout_key`] gives:
    /// a recompute draws the same mask, so gradients stay bit-identical to plain candle's. The
    /// stage's own dropout, composed of candle ops (candle keeps the mask for backward);
    /// `candle_nn::ops::dropout` draws from candle's generator, which a recompute cannot replay.
    /// A half-precision `x` is multiplied in f32 and rounded once (`1 / (1 - p)` is seldom a
    /// half-precision number), as a fused dropout computes it.
    pub fn dropout(&self, x: &Tensor, p: f32) -> candle_core::Result<Tensor> {
        let Some(key) = self.dropout_key(p)? else { return Ok(x.clone()) };
        let wide = match x.dtype() {
            DType::BF16 | DType::F16 => x.to_dtype(DType::F32)?,
            _ => x.clone(),
        };
        (&wide * key.dropout_mask_like(&wide, p)?)?.to_dtype(x.dtype())
    }

    /// The key of a dropout with drop probability `p` at this call site, or `None` where the
    /// dropout is the identity (evaluation, `p == 0`); an error for `p` outside [0, 1). A key is
    /// drawn only for a mask that is applied, so a dropout of `p == 0` changes no later draw.
    /// Every dropout draws its key here ([`StageCtx::dropout`], and a fused dropout of its own
    /// that applies [`crate::rng::DropoutRule`]), so both give one mask for one call site.
    pub fn dropout_key(&self, p: f32) -> candle_core::Result<Option<RngKey>> {
        if !(0.0..1.0).contains(&p) {
            candle_core::bail!("dropout probability must be in [0, 1), got {p}")
        }
        Ok((self.train && p > 0.0).then(|| self.next_key()))
    }
}

/// How a forward outside the executor runs (a model's `logits`, say): for evaluation, or as the
/// executor's training step `step` of a run seeded `seed` runs it, the same dropout masks drawn.
/// A training forward updates BatchNorm's running statistics, as the step's forward does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunMode {
    /// No dropout, BatchNorm on its running statistics.
    Eval,
    /// Training mode, each stage's random draws those of the step.
    Train {
        /// The run's seed (the executor's).
        seed: u64,
        /// The step.
        step: u64,
    },
}

impl RunMode {
    /// The context of stage `stage` (its index in the model's graph).
    pub fn ctx(self, stage: usize) -> StageCtx {
        match self {
            RunMode::Eval => StageCtx::eval(),
            RunMode::Train { seed, step } => StageCtx::train(seed, step, stage),
        }
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
            fn forward(
                &self,
                inputs: &[Tensor],
                ctx: &StageCtx,
            ) -> candle_core::Result<Vec<Tensor>> {
                (**self).forward(inputs, ctx)
            }
            fn signature(&self) -> Option<Signature> {
                (**self).signature()
            }
        }
    };
}
use std::sync::Arc;
forward_stage!(Arc);
forward_stage!(Box);

/// A candle [`Module`](candle_core::Module) as a stage of `kind`, in one line:
/// `remat::module("h.0", StageKind::Block, layer)` (a `DownsampleBlock` for a block that halves
/// the resolution, which `before-downsample` cuts before). The module must be deterministic:
/// dropout through [`StageCtx::dropout`] in a [`from_fn`] stage, not `candle_nn::ops::dropout`
/// (a recompute could not draw its mask again), and no state updated in forward.
pub fn module<M: candle_core::Module + 'static>(name: &str, kind: StageKind, m: M) -> impl Stage {
    Module { name: name.to_string(), kind, m }
}

struct Module<M> {
    name: String,
    kind: StageKind,
    m: M,
}

impl<M: candle_core::Module> Stage for Module<M> {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn kind(&self) -> StageKind {
        self.kind
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
