//! The layers a model calls, each beside the kernel behind it in `fused`: BatchNorm, LayerNorm and
//! GroupNorm, the linear layer with its adapter, the convolutions and the max-poolings. Each
//! picks its route (the fused CPU kernel, the device-generic route, or candle's composed ops)
//! and holds what the kernel does not: parameters, running statistics, the recording of
//! convolution calls. Not here: the kernels (`fused`), dropout and attention (the crate's root).

mod batch_norm;
mod convolution;
mod linear;
mod norm;
mod pooling;
#[cfg(test)]
mod testing;

pub use batch_norm::BatchNorm;
pub use convolution::{conv2d, conv3d, conv3d_concat, conv_transpose3d_k2s2};
pub use linear::Linear;
pub use norm::{GroupNorm, LayerNorm, RmsNorm};
pub use pooling::{max_pool2d_k3s2p1, max_pool3d_k2s2};
