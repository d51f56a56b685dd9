//! The precision a model computes in (`--dtype`): its parameters stay f32 (the master weights the
//! optimizer updates, and their gradients); its activations, and the gradients that flow between
//! them, are stored in this dtype. The fused kernels compute in f32 whatever they store.

use candle_core::DType;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    #[default]
    F32,
    Bf16,
    /// Needs loss scaling: small gradients underflow f16.
    F16,
}

named_choice!(Precision, "dtype", [Precision::F32 => "f32", Precision::Bf16 => "bf16", Precision::F16 => "f16"]);

impl Precision {
    /// The dtype activations are stored in.
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::F16 => DType::F16,
        }
    }
}
