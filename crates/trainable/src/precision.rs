//! The precision a model computes in (`--dtype`). Under `f32`, `bf16` and `f16` its parameters
//! stay f32 (the master weights the optimizer updates, and their gradients) and its activations,
//! and the gradients that flow between them, are stored in the named dtype. Under `bf16-weights`
//! the parameters and their gradients are bf16 too, with no f32 copy: 4 bytes per parameter
//! instead of 8, the optimizer's moments still f32. The fused kernels compute in f32 whatever they
//! store.

use candle_core::DType;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    #[default]
    F32,
    Bf16,
    /// Needs loss scaling: small gradients underflow f16.
    F16,
    /// bf16 activations, parameters and gradients; f32 optimizer moments. An update smaller than
    /// a weight's bf16 spacing (about 1/256 of its magnitude) is lost in the rounding, which the
    /// f32 master weights of `bf16` avoid.
    Bf16Weights,
}

named_choice!(Precision, "dtype", [
    Precision::F32 => "f32",
    Precision::Bf16 => "bf16",
    Precision::F16 => "f16",
    Precision::Bf16Weights => "bf16-weights",
]);

impl Precision {
    /// The dtype activations are stored in.
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 | Precision::Bf16Weights => DType::BF16,
            Precision::F16 => DType::F16,
        }
    }

    /// The dtype parameters and their gradients are stored in.
    pub fn weights(self) -> DType {
        match self {
            Precision::Bf16Weights => DType::BF16,
            _ => DType::F32,
        }
    }
}
