//! Selective recompute: inside a segment that will be recomputed, the outputs of the ops a policy
//! names (matrix products, convolutions, attention) are kept from the forward, and the recompute
//! replays them instead of computing them again, so it runs only the cheap ops in between (norms,
//! activations, dropout, additions). `sqrt+keep=matmul` is PyTorch's selective activation
//! checkpointing with matrix products on its save list.
//!
//! An op can be kept where its code runs it through [`op`], which hands it the kept output where
//! there is one: candle's and candle-nn's own ops do not (a model wraps its own matrix products,
//! attention or convolutions; this repository's `ops` crate does for its linear, attention and
//! convolutions). The op returns that output as its own, with its own backward: the gradients are
//! the op's on the forward's bits, so they equal `off` bit for bit. Ops are matched by their order
//! within their stage: a stage is a pure function ([`crate::Stage`]), so the n-th keepable op of
//! its recompute is the n-th of its forward.
//!
//! Rule 10 ([`crate::rules`]): a kept output is held from its op's forward until the op replays it
//! in its segment's recompute; the last segment keeps nothing (its graphs are kept anyway).

use crate::memory::tensor_bytes;
use candle_core::Tensor;
use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::rc::Rc;
use std::str::FromStr;
use std::time::Instant;

/// The kinds of op whose outputs a policy may keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OpKind {
    /// Linear layers' matrix products (LoRA's included).
    Matmul,
    /// Convolutions, transposed ones included.
    Conv,
    /// Scaled dot-product attention's output.
    Attention,
}

impl OpKind {
    /// Every kind, in order.
    pub const ALL: [OpKind; 3] = [OpKind::Matmul, OpKind::Conv, OpKind::Attention];

    /// The kind as policies write it (`matmul`, `conv`, `attention`).
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Matmul => "matmul",
            OpKind::Conv => "conv",
            OpKind::Attention => "attention",
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// A set of op kinds: what a policy keeps. Written `matmul+attention` (a comma list is read too;
/// the `+` keeps a policy's name free of commas, which separate the policies of a list).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct OpSet(u8);

impl OpSet {
    /// Every kind.
    pub fn all() -> OpSet {
        OpKind::ALL.into_iter().collect()
    }

    /// Whether `kind` is in the set.
    pub fn contains(self, kind: OpKind) -> bool {
        self.0 & kind.bit() != 0
    }

    /// Whether the set is empty (a policy without `+keep=`).
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The set's kinds, in [`OpKind::ALL`]'s order.
    pub fn kinds(self) -> impl Iterator<Item = OpKind> {
        OpKind::ALL.into_iter().filter(move |k| self.contains(*k))
    }
}

impl FromIterator<OpKind> for OpSet {
    fn from_iter<I: IntoIterator<Item = OpKind>>(kinds: I) -> Self {
        OpSet(kinds.into_iter().fold(0, |bits, k| bits | k.bit()))
    }
}

impl fmt::Display for OpSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.kinds().map(OpKind::name).collect::<Vec<_>>().join("+"))
    }
}

impl FromStr for OpSet {
    type Err = String;

    /// Kinds separated by `+` or `,`; an unknown one is refused with the list of valid ones.
    fn from_str(s: &str) -> Result<Self, String> {
        let kind = |name: &str| {
            OpKind::ALL.into_iter().find(|k| k.name() == name.trim()).ok_or_else(|| {
                let valid: Vec<&str> = OpKind::ALL.iter().map(|k| k.name()).collect();
                format!(
                    "unknown op kind `{}` to keep; valid kinds: {}",
                    name.trim(),
                    valid.join(", ")
                )
            })
        };
        let set: OpSet =
            s.split([',', '+']).map(kind).collect::<Result<Vec<_>, _>>()?.into_iter().collect();
        if set.is_empty() {
            return Err("keep= names no op kind".into());
        }
        Ok(set)
    }
}

/// One keepable op of a stage as the planner's profile measured it: its output's bytes (what
/// keeping it holds) and its time (what replaying it saves).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KeptOp {
    /// Its kind.
    pub kind: OpKind,
    /// Bytes of its output: what keeping it holds.
    pub bytes: u64,
    /// Its forward's time in milliseconds: what replaying it saves.
    pub ms: f64,
}

/// The kept outputs of one step, by stage and by the op's place among the stage's keepable ops;
/// or, while a profile measures a stage, the ops it met.
#[derive(Clone, Default)]
pub(crate) struct Stash(Rc<RefCell<Held>>);

#[derive(Default)]
struct Held {
    kept: HashMap<(usize, usize), Tensor>,
    measured: Vec<KeptOp>,
    /// The kinds of keepable op the forwards of recomputed segments ran, kept or not.
    seen: OpSet,
}

impl Stash {
    /// The ops measured so far ([`Mode::Measure`]), taken.
    pub(crate) fn take_measured(&self) -> Vec<KeptOp> {
        std::mem::take(&mut self.0.borrow_mut().measured)
    }

    /// Whether some output is kept now (after the forward: whether the policy keeps anything).
    pub(crate) fn keeps_any(&self) -> bool {
        !self.0.borrow().kept.is_empty()
    }

    /// The kinds of keepable op that the forwards of recomputed segments ran ([`Mode::Keep`]).
    pub(crate) fn seen(&self) -> OpSet {
        self.0.borrow().seen
    }
}

/// What [`op`] does in the stage running now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// The forward of a segment that will be recomputed: keep the outputs.
    Keep,
    /// Its recompute: replay them.
    Replay,
    /// A profile's measurement of a stage: compute every keepable op, recording its bytes and time.
    Measure,
}

struct Active {
    mode: Mode,
    kinds: OpSet,
    stage: usize,
    calls: usize,
    stash: Stash,
    /// Inside an op: an op it calls (a convolution built on another) is part of it.
    busy: bool,
}

thread_local! {
    static ACTIVE: RefCell<Option<Active>> = const { RefCell::new(None) };
}

/// Selective recompute in effect for one stage run on this thread, until dropped.
pub(crate) struct Scope(());

impl Scope {
    pub(crate) fn enter(mode: Mode, kinds: OpSet, stage: usize, stash: &Stash) -> Scope {
        ACTIVE.with(|a| {
            *a.borrow_mut() =
                Some(Active { mode, kinds, stage, calls: 0, stash: stash.clone(), busy: false })
        });
        Scope(())
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        ACTIVE.with(|a| *a.borrow_mut() = None);
    }
}

/// Runs a keepable op of `kind`: `compute(None)` computes its output; `compute(Some(y))` must
/// return `y`, the output its forward kept, as the op's output with the op's backward. Outside a
/// recomputed segment's forward and recompute, or for a kind the policy does not keep, it computes.
pub fn op(
    kind: OpKind,
    compute: impl FnOnce(Option<Tensor>) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor> {
    // Decided, and the borrow released, before the op runs: an op inside it calls `op` too.
    let plan = ACTIVE.with(|a| {
        let mut a = a.borrow_mut();
        let a = a.as_mut().filter(|a| !a.busy)?;
        let key = (a.stage, a.calls);
        a.calls += 1;
        if a.mode == Mode::Keep {
            let mut held = a.stash.0.borrow_mut();
            held.seen = OpSet(held.seen.0 | kind.bit());
        }
        if !a.kinds.contains(kind) {
            return None;
        }
        a.busy = true;
        Some((a.mode, key, a.stash.clone()))
    });
    let Some((mode, key, stash)) = plan else { return compute(None) };
    let kept = if mode == Mode::Replay { stash.0.borrow_mut().kept.remove(&key) } else { None };
    let start = Instant::now();
    let out = compute(kept);
    ACTIVE.with(|a| {
        if let Some(a) = a.borrow_mut().as_mut() {
            a.busy = false;
        }
    });
    let out = out?;
    match mode {
        Mode::Keep => {
            stash.0.borrow_mut().kept.insert(key, out.detach());
        }
        Mode::Measure => {
            out.device().synchronize()?;
            let op =
                KeptOp { kind, bytes: tensor_bytes(&out), ms: start.elapsed().as_secs_f64() * 1e3 };
            stash.0.borrow_mut().measured.push(op);
        }
        Mode::Replay => {}
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_sets_parse_and_display() {
        let set: OpSet = "attention,matmul".parse().unwrap();
        assert_eq!(set.to_string(), "matmul+attention");
        assert_eq!("attention+matmul".parse::<OpSet>().unwrap(), set);
        assert!(set.contains(OpKind::Matmul) && !set.contains(OpKind::Conv));
        let e = "matmul,gemm".parse::<OpSet>().unwrap_err();
        assert!(e.contains("`gemm`") && e.contains("matmul, conv, attention"), "{e}");
    }

    #[test]
    fn a_kept_output_is_replayed_once_in_order() {
        let stash = Stash::default();
        let computed = std::cell::Cell::new(0);
        let run = |mode, x: f32| {
            let _scope = Scope::enter(mode, "matmul".parse().unwrap(), 3, &stash);
            let mut outs = Vec::new();
            for k in 0..2 {
                outs.push(
                    op(OpKind::Matmul, |kept| {
                        Ok(kept.unwrap_or_else(|| {
                            computed.set(computed.get() + 1);
                            Tensor::new(x + k as f32, &candle_core::Device::Cpu).unwrap()
                        }))
                    })
                    .unwrap(),
                );
                // An op of a kind not kept computes, and counts in the order all the same.
                op(OpKind::Conv, |kept| {
                    assert!(kept.is_none());
                    Tensor::new(0f32, &candle_core::Device::Cpu)
                })
                .unwrap();
            }
            outs.iter().map(|t| t.to_scalar::<f32>().unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(run(Mode::Keep, 1.0), [1.0, 2.0]);
        assert_eq!(run(Mode::Replay, 10.0), [1.0, 2.0], "the forward's outputs, not new ones");
        assert_eq!(computed.get(), 2, "the replay computed a kept op");
        assert!(stash.0.borrow().kept.is_empty(), "a replayed output stays held");
        assert!(op(OpKind::Matmul, |kept| {
            kept.map_or_else(|| Tensor::new(5f32, &candle_core::Device::Cpu), Ok)
        })
        .is_ok());
    }
}
