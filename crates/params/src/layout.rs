//! How a linear layer stores its weight: what the layer (the `ops` crate's `Linear`) reads it as,
//! and what merging a LoRA adapter into it ([`crate::lora`]) must know. Not here: the layer.

/// How a linear layer stores its weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// (out, in): PyTorch's `Linear` (BERT).
    OutIn,
    /// (in, out): Hugging Face's `Conv1D` (GPT-2).
    InOut,
}
