//! 3D convolution: in f32 on AVX2 or AVX-512 directly ([`direct`]: forward, unit-stride input
//! gradient and weight gradient of every kernel but 1x1x1); else by an operand matrix built in
//! blocks (the column matrix, or for 8 or more input channels the patch matrix) and a matrix
//! product per block, none built for a 1x1x1 kernel (strided, of the voxels it reads, taken out
//! first). Its input gradient a convolution too where the stride is one: keeps its input and
//! output only.
//! Its input may come in two tensors whose channels side by side are the input (a U-Net decoder's
//! skip and up-sampled tensors): the concatenation is never made, nor kept.
//!
//! Here, what the rest of the crate calls; each part of the kernel in its own module:
//! `shape` (the sizes of one convolution), `input` (its input, in one tensor or two), `blocks`
//! (the operand matrix's blocks), `layout` (column or patch matrix, and the kernel in it),
//! `operand_matrix` (building a block of it), `convolve` (the output, by matrix products or
//! directly), `pointwise` (1x1x1 kernels), `backward` (the gradients), `op` (the custom op),
//! `generic` (the device-generic route), `k2s2_gradients` (the up-convolution's gradients by the
//! direct kernels), `direct` (the direct kernels). Not here: the convolutions composed from candle
//! ops (`fused::composed`), the layer a model calls (the crate's `conv3d`).

mod backward;
mod blocks;
mod convolve;
mod direct;
mod generic;
mod input;
mod k2s2_gradients;
mod layout;
mod normalised;
mod op;
mod operand_matrix;
mod pointwise;
mod shape;

pub(crate) use generic::{conv3d_concat_generic, conv3d_generic};
pub(crate) use k2s2_gradients::{k2s2_gradients_directly, Gradients};
pub use normalised::batch_norm_relu_conv3d;
pub use shape::Conv3dGeometry;

use crate::fused::dtype::operand;
use crate::fused::replay::{apply2, apply3};
use candle_core::{Result, Tensor};
use op::Conv3dOp;
use shape::Conv3dShape;

/// How a convolution reads its weights `w`: as its own kernel, or as the kernel of the
/// convolution whose input gradient it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    /// w (O, C, kd, kh, kw), this convolution's own kernel, as stored.
    AsIs,
    /// w (C, O, kd, kh, kw), the kernel of the convolution whose input gradient this one is
    /// ([`Conv3dShape::transposed`]), read with its channel axes swapped and turned end over end
    /// along all three spatial axes.
    Flipped,
}

/// 3D convolution of x (N, C, D, H, W) with w (O, C, kd, kh, kw) by a matrix product per block
/// of its operand matrix (one workspace for all blocks, [`Conv3dShape::sized`]). It keeps nothing
/// but its input and output: the operand matrix is built again in backward (the composed version
/// in `fused::composed` keeps 7 copies of its input).
/// `kept`: its output, kept from the forward (`remat::keep`).
pub(crate) fn conv3d(
    x: &Tensor,
    w: &Tensor,
    g: Conv3dGeometry,
    kept: Option<Tensor>,
) -> Result<Tensor> {
    let shape = Conv3dShape::new(x.dims5()?, w.dims5()?, g, BLOCK_ENTRIES)?.sized();
    apply2(&x.contiguous()?, &operand(w, x)?, Conv3dOp { shape, split: None }, kept)
}

/// Entries of an operand-matrix block at most (4 MiB in f32): the one workspace's size. A decoder
/// level's backward holds it beside both input gradients, so it adds to the U-Net's step peak
/// (8 MiB blocks: 4 MiB more), while the products stay wide enough for gemm's blocking at no
/// measured cost in time (`bench-harness run-one`, U-Net small and ResNet-50/152).
const BLOCK_ENTRIES: usize = 1 << 20;

/// [`conv3d`] building the column matrix in blocks of at most about `block_entries` entries
/// whatever the problem's size (at least one output row; see `Conv3dShape::blocks`): the tests'
/// way to take each kind of block.
#[cfg(test)]
pub(crate) fn conv3d_blocked(
    x: &Tensor,
    w: &Tensor,
    g: Conv3dGeometry,
    block_entries: usize,
) -> Result<Tensor> {
    let shape = Conv3dShape::new(x.dims5()?, w.dims5()?, g, block_entries)?;
    apply2(&x.contiguous()?, &operand(w, x)?, Conv3dOp { shape, split: None }, None)
}

/// [`conv3d`] of the channel concatenation of a (N, Ca, D, H, W) and b (N, Cb, D, H, W) with w
/// (O, Ca + Cb, kd, kh, kw), without making it: the patch matrix reads each channel from where it
/// is, and the input gradient comes out as the two tensors' gradients. Keeps a, b and the output
/// (the concatenation and its two inputs, composed).
pub(crate) fn conv3d_concat(
    a: &Tensor,
    b: &Tensor,
    w: &Tensor,
    g: Conv3dGeometry,
    kept: Option<Tensor>,
) -> Result<Tensor> {
    let (x, split) = concat_dims(a, b)?;
    let shape = Conv3dShape::new(x, w.dims5()?, g, BLOCK_ENTRIES)?.sized();
    apply3(
        &a.contiguous()?,
        &b.contiguous()?,
        &operand(w, a)?,
        Conv3dOp { shape, split: Some(split) },
        kept,
    )
}

/// (N, C, D, H, W) of a 3D convolution's input.
type Dims5 = (usize, usize, usize, usize, usize);

/// The dims of the channel concatenation of a and b, and a's channels; both must agree elsewhere.
fn concat_dims(a: &Tensor, b: &Tensor) -> Result<(Dims5, usize)> {
    let ((n, ca, d, h, w), (nb, cb, db, hb, wb)) = (a.dims5()?, b.dims5()?);
    if (n, d, h, w) != (nb, db, hb, wb) || a.dtype() != b.dtype() {
        candle_core::bail!(
            "conv3d_concat: {:?} {:?} and {:?} {:?} differ beyond their channels",
            a.dims(),
            a.dtype(),
            b.dims(),
            b.dtype()
        )
    }
    Ok(((n, ca + cb, d, h, w), ca))
}
