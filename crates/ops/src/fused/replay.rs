//! Selective recompute (`remat::keep`) for the fused ops: an op whose forward kept its output
//! runs, in the recompute, as [`Replay`] of that output with the op's own backward. [`apply2`],
//! [`apply3`] and [`kept_or`] pick the op or its replay. Not here: which ops are kept and when
//! (`remat::keep`), the device-generic route's own handling of a kept output (`generic`).

use super::generic::{copied, cpu};
use super::op::{FusedOp, Operand};
use candle_core::{CpuStorage, Result, Shape, Tensor};
use std::sync::Mutex;

/// A fused op whose output is given: the output its forward kept under selective recompute
/// (`remat::keep`), replayed in the recompute. Its forward copies that output; its backward is
/// the op's, so the gradients are the op's own.
pub(crate) struct Replay<O> {
    op: O,
    out: Mutex<Option<Tensor>>,
}

impl<O: FusedOp> Replay<O> {
    pub(crate) fn new(op: O, out: Tensor) -> Self {
        Replay { op, out: Mutex::new(Some(out)) }
    }
}

impl<O: FusedOp> FusedOp for Replay<O> {
    fn cpu_fwd(&self, _: &[Operand]) -> Result<(CpuStorage, Shape)> {
        copied("replayed op", &self.out, cpu)
    }

    fn bwd(&self, inputs: &[&Tensor], out: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        self.op.bwd(inputs, out, grad)
    }
}

/// `a op b`, or with `kept` (its output kept from the forward under selective recompute,
/// `remat::keep`) the op's replay: that output, with the op's backward.
pub(crate) fn apply2<O>(a: &Tensor, b: &Tensor, op: O, kept: Option<Tensor>) -> Result<Tensor>
where
    O: FusedOp + candle_core::CustomOp2 + Send + Sync + 'static,
    Replay<O>: candle_core::CustomOp2 + Send + Sync + 'static,
{
    match kept {
        Some(y) => a.apply_op2(b, Replay::new(op, y)),
        None => a.apply_op2(b, op),
    }
}

/// [`apply2`] of an op over three operands.
pub(crate) fn apply3<O>(
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    op: O,
    kept: Option<Tensor>,
) -> Result<Tensor>
where
    O: FusedOp + candle_core::CustomOp3 + Send + Sync + 'static,
    Replay<O>: candle_core::CustomOp3 + Send + Sync + 'static,
{
    match kept {
        Some(y) => a.apply_op3(b, c, Replay::new(op, y)),
        None => a.apply_op3(b, c, op),
    }
}

/// The output an op computes with `compute`, or the one its forward kept (`kept`).
pub(crate) fn kept_or(
    kept: Option<Tensor>,
    compute: impl FnOnce() -> Result<Tensor>,
) -> Result<Tensor> {
    match kept {
        Some(y) => Ok(y),
        None => compute(),
    }
}
