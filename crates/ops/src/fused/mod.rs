//! Fused training ops: each one candle custom op whose backward keeps only what it needs, where the
//! same op composed from elementwise candle ops keeps every intermediate alive until backward ends
//! (a composed LayerNorm holds 5 tensors of its input's size, a composed softmax 3, a composed
//! cross-entropy 3 of the logits' size).
//!
//! - [`layer_norm()`]: keeps nothing but its input (the statistics are recomputed in backward).
//! - [`softmax_last_dim()`]: with an optional scale and causal mask ([`Mask`]) folded in, keeps
//!   only its output.
//! - [`cross_entropy()`]: the mean (optionally weighted) negative log-likelihood of logits; keeps
//!   nothing but its inputs.
//! - [`batch_norm_train()`]: BatchNorm in training mode, optionally with the ReLU that follows it
//!   ([`Activation`]);
//!   [`batch_norm_pair_train()`]: two BatchNorms added and a ReLU (a downsampling block's end);
//!   keeps its input and output (a composed BatchNorm + ReLU keeps 7 tensors of that size).
//! - [`dropout()`]: inverted dropout whose backward draws the mask again from its key instead of
//!   holding it; its bits equal `x * mask` composed.
//! - [`embedding()`]: a row lookup whose backward builds the table's gradient in one allocation.
//! - [`linear()`]: `x @ w + b` as one op, so the product before the bias is not kept; the weight
//!   in either layout (`params::WeightLayout`). [`linear_residual()`]: `r + x @ w` as one op, a
//!   residual branch's last projection and the addition after it, so the product is not kept. [`lora_linear()`]: a frozen linear layer with its
//!   LoRA adapter as one op, the adapter's product added into the base product's output; keeps
//!   `x` and the adapter's weights, computes no gradient of the frozen weight. [`gelu_linear()`]
//!   (and `lora_linear` of [`LinearInput::Gelu`]): of a GELU's output, keeping the GELU's input
//!   only, the GELU made again in backward.
//! - [`gelu()`]: tanh or erf GELU ([`GeluForm`]) with a one-pass, multi-threaded backward; in f32
//!   by vectorised formulas.
//! - [`rms_norm()`]: RMSNorm (Llama's); keeps nothing but its input.
//! - [`silu_mul()`]: the SiLU-gated product of a gated MLP; keeps its two operands, not the
//!   activation between them.
//! - [`attention()`]: scaled dot-product attention with causal mask and dropout; keeps only q, k, v
//!   (scores and probabilities are rebuilt in backward). [`rotary_attention()`]: the same with q
//!   and k turned by a rotary embedding ([`Rotary`]) inside the op, so the turned copies are
//!   rebuilt in backward too, its operands and output laid out token by token as the projections
//!   give and take them (no heads-first copies in the graph).
//! - `max_pool2d`, `max_pool3d` (through the crate's `max_pool2d_k3s2p1` and `max_pool3d_k2s2`):
//!   keep only their input; backward finds each window's maximum again.
//! - `conv_transpose3d_k2s2` (through the crate's function of that name): the U-Net up-convolution
//!   with its bias, one matrix product per sample; its gradients by the direct kernels (a stride-2
//!   convolution of its output gradient); keeps only its input.
//! - `conv3d` (through the crate's `conv3d`): in f32 on AVX2 or AVX-512, direct convolution
//!   (output tiles in vector registers, every input channel and tap added in, oneDNN's way: the
//!   `conv3d::direct` module) for the forward and both gradients of every kernel but 1x1x1; a
//!   1x1x1 kernel, f64, or another processor, a matrix product per block of an operand matrix
//!   built in blocks (vol2col), built again in backward. Keeps its input and output only. Through
//!   `conv3d_concat`, of two tensors' channels side by side, never concatenated.
//!   [`batch_norm_relu_conv3d()`] (through `BatchNorm::forward_relu_conv3d` and its 2D form): of a
//!   BatchNorm + ReLU's output in f32 or f64, one op that keeps the BatchNorm's input only and
//!   normalises it again in backward.
//! - The `composed` module: the same convolutions composed from candle ops, for any device.
//!
//! Every kernel of ours works row by row (or channel by channel), each sequentially on one thread,
//! and every reduction across rows sums fixed chunks in a fixed order: the same inputs give the
//! same bits whatever the number of threads; the direct convolutions make each output element in
//! one tile, its sum in one fixed order. The ops that multiply matrices (linear, attention,
//! conv3d where it is not direct) use gemm, candle's matrix product, called on the operands'
//! elements in place (`matmul`): the same bits every time, so a recompute under checkpointing is
//! bit-identical to the forward. `exp` of f32 is ours (`exp`), and so are GELU's f32 formulas,
//! vectorised, the same bits on every processor.
//!
//! f32 and f64 tensors on the CPU take the fused path, and so do bf16 and f16 ones: their kernels
//! read the half-precision operands widened to f32 (a transient copy per op), compute in f32 and
//! store results in the operands' dtype, so what an op keeps for backward stays in half precision
//! (candle's CPU backend has no bf16 matrix product at all). A half-precision activation may meet
//! f32 weights: each operand is read in its own dtype, and each gradient is made in its operand's
//! dtype, so f32 weights get f32 gradients. Cross-entropy returns an f32 loss.
//!
//! On a CUDA device every op takes its device-generic route (the `generic` module): the same op,
//! keeping the same tensors for backward, its forward and backward composed from candle's device
//! kernels inside the custom op. [`set_path`] forces that route on the CPU, where the tests prove
//! it. Anything else (Metal, integer tensors) falls back to the composed candle ops.
//!
//! What the ops share, each in its module: `macros` (the element-type dispatch and the custom-op
//! impls), `op` (the `FusedOp` frame), `route` (which implementation an op takes),
//! `generic` (the device-generic route), `replay` (an op replayed from its kept output under
//! selective recompute), `dtype` (the dtype an op computes in), `storage` (a CPU tensor's
//! elements as slices), `elem` (the float types the kernels run in), `parallel` (work split over
//! threads with the same bits at any number of them), `matmul` (the matrix product, called on
//! slices), `uninit` (buffers written whole before they are read). Here: the modules and what
//! the crate and its users call.

// First: a `macro_rules!` is visible only below its definition.
#[macro_use]
mod macros;

// What the ops share.
mod dtype;
mod elem;
mod exp;
mod generic;
mod matmul;
mod op;
mod parallel;
mod replay;
mod route;
mod storage;
mod uninit;

// The ops.
mod attention;
mod batch_norm;
mod composed;
mod conv3d;
mod conv_transpose3d;
mod cross_entropy;
mod dropout;
mod embedding;
mod gelu;
mod layer_norm;
mod linear;
mod max_pool;
mod rms_norm;
mod rotary;
mod silu_mul;
mod softmax;

pub use attention::{attention, rotary_attention};
pub use batch_norm::{batch_norm_pair_train, batch_norm_train, Activation, Normalised};
pub(crate) use composed::{conv3d_composed, conv_transpose3d_k2s2_composed};
#[cfg(test)] // the convolution layers' tests force small blocks through it
pub(crate) use conv3d::conv3d_blocked;
pub use conv3d::{batch_norm_relu_conv3d, Conv3dGeometry};
pub(crate) use conv3d::{conv3d, conv3d_concat, conv3d_concat_generic, conv3d_generic};
pub(crate) use conv_transpose3d::{conv_transpose3d_k2s2, conv_transpose3d_k2s2_generic};
pub use cross_entropy::{cross_entropy, IGNORE};
pub use dropout::dropout;
pub use dtype::{is_half, widened};
pub use embedding::embedding;
pub use gelu::{gelu, GeluForm};
pub use layer_norm::layer_norm;
pub use linear::{gelu_linear, linear, linear_residual, lora_linear, LinearInput};
pub use matmul::{allocate_matmul_workspaces, matmul_peak_gflops};
pub(crate) use max_pool::{max_pool2d, max_pool3d, max_pool_generic};
pub use rms_norm::rms_norm;
pub use rotary::Rotary;
pub use route::{fused, path, set_path, Path};
pub(crate) use route::{generic, lean};
pub use silu_mul::silu_mul;
pub use softmax::{softmax_last_dim, Mask};
pub use storage::slice;
