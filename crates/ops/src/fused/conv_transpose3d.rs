//! The U-Net up-convolution (transposed 3D convolution, kernel = stride = 2) with its bias, one
//! matrix product per sample: keeps only its input. Not here: its gradients by the direct
//! convolution kernels (`conv3d::k2s2_gradients`), its composed form (`composed`).

use crate::fused::composed::conv_transpose3d_k2s2_composed;
use crate::fused::conv3d::{k2s2_gradients_directly, Gradients};
use crate::fused::dtype::{operand, widened, widened_as};
use crate::fused::elem::Elem;
use crate::fused::generic::GenericOp;
use crate::fused::matmul::{mat, matmul, matmul_new, Dest};
use crate::fused::op::{exactly, FusedOp, Operand, Want};
use crate::fused::parallel::sum_lanes;
use crate::fused::replay::{apply3, kept_or, Replay};
use crate::fused::storage::{shaped, slice, with_slice};
use candle_core::{CpuStorage, Result, Shape, Tensor};
use rayon::prelude::*;

/// `conv_transpose3d(x, w, stride 2) + b` for x (N, C, D, H, W), w (C, O, 2, 2, 2), b (O): every
/// input voxel writes its own 2x2x2 output block, so it is one matrix product per sample and a
/// scatter. One op: it keeps only x (the composed version keeps the product, its permuted copy
/// and the sum before the bias). CPU f32/f64 only: check [`fused`](crate::fused::fused) first.
/// `kept`: its output, kept from the forward (`remat::keep`).
pub(crate) fn conv_transpose3d_k2s2(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    kept: Option<Tensor>,
) -> Result<Tensor> {
    let (n, c, d, h, wd) = x.dims5()?;
    let (c_w, o, ..) = w.dims5()?;
    if c != c_w || w.dims()[2..] != [2, 2, 2] || b.dims() != [o] {
        candle_core::bail!(
            "conv_transpose3d_k2s2: kernel {:?} and bias {:?} do not fit input with {c} channels",
            w.dims(),
            b.dims()
        )
    }
    let op = ConvTranspose3dOp { n, c, o, input: [d, h, wd] };
    apply3(&x.contiguous()?, &operand(w, x)?, &operand(b, x)?, op, kept)
}

/// The generic route ([`crate::fused::generic`]): the composed form (one matrix product, a reshape,
/// the bias) on detached operands, and its backward composed: the output gradient gathered back
/// into (voxels, O 8) columns gives the input's gradient by one product with the weight and the
/// weight's by one product with the input. Keeps what the kernel keeps: x (w and b).
pub(crate) fn conv_transpose3d_k2s2_generic(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    kept: Option<Tensor>,
) -> Result<Tensor> {
    let y = kept_or(kept, || {
        let (xd, wd, bd) =
            (widened(&x.detach())?, widened_as(&w.detach(), x)?, widened_as(&b.detach(), x)?);
        conv_transpose3d_k2s2_composed(&xd, &wd, &bd)?.to_dtype(x.dtype())
    })?;
    let backward = move |inputs: &[Tensor],
                         _y: &Tensor,
                         grad: &Tensor,
                         _want: &[bool]|
          -> Result<Vec<Option<Tensor>>> {
        let [x, w, b] = exactly(&inputs.iter().collect::<Vec<_>>())?;
        let (n, c, d, h, wd) = x.dims5()?;
        let o = w.dim(1)?;
        let voxels = n * d * h * wd;
        let g = widened_as(grad, x)?.reshape(vec![n, o, d, 2, h, 2, wd, 2])?;
        // (N D H W, O 8)
        let g_cols = g.permute([0, 2, 4, 6, 1, 3, 5, 7])?.reshape((voxels, o * 8))?;
        let w_mat = widened_as(w, x)?.reshape((c, o * 8))?; // (C, O 8)
                                                            // (N, C, D, H, W)
        let dx = g_cols.matmul(&w_mat.t()?)?.reshape((n, d, h, wd, c))?.permute((0, 4, 1, 2, 3))?;
        let cols = widened(x)?.permute((0, 2, 3, 4, 1))?.reshape((voxels, c))?; // (N D H W, C)
        let dw = cols.t()?.matmul(&g_cols)?.reshape(w.shape())?;
        let db = g_cols.reshape((voxels, o, 8))?.sum((0, 2))?;
        Ok(vec![
            Some(dx.to_dtype(x.dtype())?),
            Some(dw.to_dtype(w.dtype())?),
            Some(db.to_dtype(b.dtype())?),
        ])
    };
    x.contiguous()?.apply_op3(
        &w.contiguous()?,
        &b.contiguous()?,
        GenericOp::new("generic-conv-transpose3d", y, Box::new(backward)),
    )
}

struct ConvTranspose3dOp {
    n: usize,
    c: usize,
    o: usize,
    input: [usize; 3],
}

impl ConvTranspose3dOp {
    fn volume(&self) -> usize {
        self.input.iter().product()
    }

    /// Calls `f(row of the (O 8, DHW) product, column, output index within the sample)` for every
    /// output voxel of output channel `oc`.
    fn for_channel(&self, oc: usize, mut f: impl FnMut(usize, usize, usize)) {
        let [d, h, w] = self.input;
        for k in 0..8 {
            let (a, p, q) = (k / 4, (k / 2) % 2, k % 2);
            for z in 0..d {
                for i in 0..h {
                    for j in 0..w {
                        let out =
                            ((oc * 2 * d + 2 * z + a) * 2 * h + 2 * i + p) * 2 * w + 2 * j + q;
                        f(oc * 8 + k, (z * h + i) * w + j, out);
                    }
                }
            }
        }
    }

    fn forward<T: Elem>(&self, x: &[T], w: &[T], b: &[T]) -> Result<Vec<T>> {
        let (v, ok) = (self.volume(), self.o * 8);
        let mut y = vec![T::zero(); self.n * ok * v];
        for (x, y) in x.chunks(self.c * v).zip(y.chunks_mut(ok * v)) {
            let prod = matmul_new(mat(w).transposed(), mat(x), (ok, self.c, v)); // (O 8, DHW)
            y.par_chunks_mut(8 * v).enumerate().for_each(|(oc, y)| {
                self.for_channel(oc, |r, col, out| y[out - oc * 8 * v] = prod[r * v + col] + b[oc])
            });
        }
        Ok(y)
    }

    /// dx and dW (where `want` asks for them) by the direct kernels where they take them, else per
    /// sample, with G (O 8, DHW) the output gradient gathered back into the product's layout:
    /// dx = W G, dW += x G^T; db the sums of each output channel's gradient, samples in order.
    fn backward<T: Elem>(
        &self,
        x: &[T],
        w: &[T],
        gy: &[T],
        want: Want,
    ) -> Result<(Gradients<T>, Vec<T>)> {
        let per_channel = 8 * self.volume();
        let db = (0..self.o)
            .into_par_iter()
            .map(|oc| {
                let sample = |n: usize| &gy[(n * self.o + oc) * per_channel..][..per_channel];
                (0..self.n).map(|n| sum_lanes(sample(n))).fold(T::zero(), |a, b| a + b)
            })
            .collect();
        let dims = (self.n, self.c, self.o, self.input);
        if let Some(gradients) = k2s2_gradients_directly(x, w, gy, dims, want) {
            return Ok((gradients, db));
        }
        let (dx, dw) = self.backward_by_products(x, w, gy)?;
        Ok(((want.dx.then_some(dx), want.dw.then_some(dw)), db))
    }

    /// dx and dW per sample by matrix products, with G (O 8, DHW) the output gradient gathered
    /// back into the product's layout: dx = W G, dW += x G^T.
    fn backward_by_products<T: Elem>(
        &self,
        x: &[T],
        w: &[T],
        gy: &[T],
    ) -> Result<(Vec<T>, Vec<T>)> {
        let (v, ok) = (self.volume(), self.o * 8);
        let (mut dx, mut dw) = (Vec::with_capacity(x.len()), vec![T::zero(); w.len()]);
        for (x, gy) in x.chunks(self.c * v).zip(gy.chunks(ok * v)) {
            let mut g = vec![T::zero(); ok * v];
            g.par_chunks_mut(8 * v).enumerate().for_each(|(oc, g)| {
                self.for_channel(oc, |r, col, out| g[(r - oc * 8) * v + col] = gy[out])
            });
            // dW += (C, O 8), dx gets (C, DHW)
            matmul(&mut dw, mat(x), mat(&g).transposed(), (self.c, v, ok), Dest::Accumulate);
            dx.extend(matmul_new(mat(w), mat(&g), (self.c, ok, v)));
        }
        Ok((dx, dw))
    }
}

impl FusedOp for ConvTranspose3dOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let [(x, xl), (w, wl), (b, bl)] = exactly(inputs)?;
        let y = per_float!(
            x,
            "conv_transpose3d",
            self.forward(&slice(x, xl)?, &slice(w, wl)?, &slice(b, bl)?)?
        );
        let [d, h, w] = self.input;
        Ok((y, Shape::from(vec![self.n, self.o, 2 * d, 2 * h, 2 * w])))
    }

    fn bwd(&self, inputs: &[&Tensor], _y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [x, w, b] = exactly(inputs)?;
        let g = g.contiguous()?;
        let want = Want { dx: x.track_op(), dw: w.track_op() };
        per_dtype!(x.dtype(), T => {
            let ((dx, dw), db) = with_slice::<T, _>(x, |xs| {
                with_slice(w, |ws| with_slice(&g, |gs| self.backward(xs, ws, gs, want)))
            })?;
            let dx = dx.map(|dx| shaped(dx, x)).transpose()?;
            Ok(vec![dx, dw.map(|dw| shaped(dw, w)).transpose()?, Some(shaped(db, b)?)])
        })
    }
}

custom_op!(ConvTranspose3dOp: 3 "fused-conv-transpose3d-k2s2");
custom_op!(Replay<ConvTranspose3dOp>: 3 "replayed-conv-transpose3d");
