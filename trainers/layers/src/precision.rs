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

impl Precision {
    pub const NAMES: &'static str = "f32, bf16, f16";

    /// The dtype activations are stored in.
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::F16 => DType::F16,
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            "f16" => Ok(Precision::F16),
            _ => Err(format!("unknown dtype `{s}`; valid dtypes: {}", Precision::NAMES)),
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        })
    }
}
