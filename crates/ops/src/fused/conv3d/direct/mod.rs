//! Direct convolution in f32 on x86-64 with AVX-512, or AVX2 and FMA, chosen at run time: no
//! operand matrix. An output tile of T channels x R rows x Q columns lives in vector registers
//! (T channels side by side in a vector) while every input channel and kernel tap adds into it:
//! each step loads T weights and broadcasts R x Q input elements, one multiply-add per pair, which
//! is oneDNN's forward kernel on a channel-blocked layout. The input is read from a zero-padded
//! copy of a few depth planes at a time (a slab), so a tap is one fixed offset for every position
//! and no border needs a test; the weights are repacked as (O / T, C, taps, T).
//!
//! Each output element is one tile's sum over the channels and taps in a fixed order, whatever the
//! threads: the bits do not depend on their number. Not here: other element types (f64 takes the
//! matrix products), 1x1x1 kernels (a matrix product of the input, strided or not, which the
//! kernel bench times faster than these tiles at the ResNets' shapes), column strides above 2.
//!
//! The parts: `plan` (the instruction set and the tile a convolution takes), `slab` (the
//! zero-padded input planes a block reads), `forward` (the convolution by output tiles),
//! `weight_gradient` (the weight gradient by kernel-row tiles), `simd` (the two register-tile
//! kernels over a vector type), `x86` (their AVX2 and AVX-512 instances).

mod forward;
mod plan;
mod simd;
mod slab;
#[cfg(test)]
mod tests;
mod weight_gradient;
#[cfg(target_arch = "x86_64")]
mod x86;

pub(crate) use forward::convolve;
pub(crate) use plan::{Plan, WeightPlan};
pub(crate) use weight_gradient::weight_gradient;
