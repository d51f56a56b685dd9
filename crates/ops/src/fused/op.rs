//! The frame every fused op fits: [`FusedOp`], its CPU forward over its operands in order and its
//! backward, from which `custom_op!` (the `macros` module) implements candle's `CustomOp1/2/3`;
//! and [`Want`], the gradients a backward is asked for. Not here: replaying an op from its kept
//! output (`replay`), the device-generic route (`generic`).

use candle_core::{CpuStorage, Layout, Result, Shape, Tensor};

/// One operand of a custom op's CPU forward: its storage and layout.
pub(crate) type Operand<'a> = (&'a CpuStorage, &'a Layout);

/// A fused op's CPU forward and backward over its operands in order, from which `custom_op!`
/// implements candle's `CustomOp1/2/3`: an op whose last operand is optional (BatchNorm's
/// residual, linear's bias) writes each once for both arities.
pub(crate) trait FusedOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)>;

    /// One gradient per input, `None` for an input that has none (class ids).
    fn bwd(&self, inputs: &[&Tensor], out: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>>;
}

/// The operands of an op that takes exactly `N` (what `custom_op!` passes at arity `N`).
pub(crate) fn exactly<const N: usize, T: Copy>(inputs: &[T]) -> Result<[T; N]> {
    inputs.try_into().map_err(|_| {
        candle_core::Error::Msg(format!(
            "fused op: {} operands where {N} were expected",
            inputs.len()
        ))
    })
}

/// `FusedOp::bwd`'s gradients as the `N` that `CustomOpN::bwd` returns.
pub(crate) fn gradients<const N: usize>(
    grads: Vec<Option<Tensor>>,
    name: &str,
) -> Result<[Option<Tensor>; N]> {
    grads.try_into().map_err(|g: Vec<_>| {
        candle_core::Error::Msg(format!("{name}: {} gradients for {N} operands", g.len()))
    })
}

/// The gradients a backward of an op over an input and a weight is asked for: those of operands
/// some variable leads to (not an image, not a frozen weight). One not wanted is not computed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Want {
    /// The input's gradient.
    pub(crate) dx: bool,
    /// The weight's gradient.
    pub(crate) dw: bool,
}
