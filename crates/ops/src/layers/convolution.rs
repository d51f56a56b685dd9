//! The convolution layers a model calls: 3D convolution (of one tensor, or of two tensors'
//! channels side by side), the 2D convolution as a 3D one of depth 1, and the U-Net
//! up-convolution, which candle lacks or runs with a heavy backward: on the CPU the fused
//! kernels, on the generic route one op each, elsewhere composed from ops that have a backward;
//! each call recorded for the kernel bench. Not here: the kernels (`fused::conv3d`,
//! `fused::conv_transpose3d`, `fused::composed`), pooling (`layers::pooling`).

use crate::fused::{conv3d_composed, conv_transpose3d_k2s2_composed, Conv3dGeometry};
use crate::recorded::{recorded, ConvCall, ConvKind};
use candle_core::{Result, Tensor};
use remat::keep::OpKind;

/// 3D convolution of x (N, C, D, H, W) with w (O, C, kd, kh, kw): on the CPU the fused kernels
/// (`crate::fused`: direct convolution in f32 on AVX2 or AVX-512, else vol2col and matrix
/// products); elsewhere the sum over kernel depth of 2D convolutions, with
/// the output depth folded into the batch, as one op on the generic route (it keeps x and w).
pub fn conv3d(x: &Tensor, w: &Tensor, g: Conv3dGeometry) -> Result<Tensor> {
    recorded(ConvKind::Conv3d, &[x, w], g, || conv3d_unrecorded(x, w, g))
}

fn conv3d_unrecorded(x: &Tensor, w: &Tensor, g: Conv3dGeometry) -> Result<Tensor> {
    if !crate::fused::lean(x) {
        return conv3d_composed(x, w, g);
    }
    remat::keep::op(OpKind::Conv, |kept| match crate::fused::generic(x) {
        true => crate::fused::conv3d_generic(x, w, g, kept),
        false => crate::fused::conv3d(x, w, g, kept),
    })
}

/// [`conv3d`] of the channel concatenation of a (N, Ca, D, H, W) and b (N, Cb, D, H, W), the
/// U-Net decoder's skip and up-sampled tensors, with w (O, Ca + Cb, kd, kh, kw), as
/// `conv3d(cat([a, b], 1), w)` but never making the concatenation: on the CPU kernels and the
/// generic route it keeps a, b and w only (composed, the concatenation too: the size of both).
pub fn conv3d_concat(a: &Tensor, b: &Tensor, w: &Tensor, g: Conv3dGeometry) -> Result<Tensor> {
    recorded(ConvKind::Conv3dConcat, &[a, b, w], g, || {
        if !crate::fused::lean(a) {
            return conv3d_composed(&Tensor::cat(&[a, b], 1)?, w, g);
        }
        remat::keep::op(OpKind::Conv, |kept| match crate::fused::generic(a) {
            true => crate::fused::conv3d_concat_generic(a, b, w, g, kept),
            false => crate::fused::conv3d_concat(a, b, w, g, kept),
        })
    })
}

/// 2D convolution of x (N, C, H, W) with w (O, C, kh, kw), one stride and padding for both sides:
/// [`conv3d`] at depth 1. On the CPU kernels the input gradient is a convolution or, strided, a
/// matrix product and col2im (candle's `conv2d` backward runs `conv_transpose2d`'s scalar
/// loops); on either route the weight gradient comes out detached (candle builds it with graph
/// ops that keep each layer's output gradient alive until the whole backward returns).
/// Elsewhere candle's `conv2d`.
pub fn conv2d(x: &Tensor, w: &Tensor, padding: usize, stride: usize) -> Result<Tensor> {
    let g = Conv3dGeometry { stride_d: 1, stride_hw: stride, pad_d: 0, pad_hw: padding };
    recorded(ConvKind::Conv2d, &[x, w], g, || {
        if !crate::fused::lean(x) {
            return x.conv2d(w, padding, stride, 1, 1);
        }
        conv3d_unrecorded(&x.unsqueeze(2)?, &w.unsqueeze(2)?, g)?.squeeze(2) // (N, O, H', W')
    })
}

/// Transposed 3D convolution with kernel = stride = 2 plus a bias (the U-Net up-convolution):
/// x (N, C, D, H, W), w (C, O, 2, 2, 2) as PyTorch stores it, b (O). Fused on the CPU in f32/f64;
/// elsewhere one matmul and a reshape, as each input voxel writes its own 2x2x2 output block.
pub fn conv_transpose3d_k2s2(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let g = Conv3dGeometry { stride_d: 2, stride_hw: 2, pad_d: 0, pad_hw: 0 };
    recorded(ConvKind::ConvTranspose3dK2S2, &[x, w, b], g, || {
        if !crate::fused::lean(x) {
            return conv_transpose3d_k2s2_composed(x, w, b);
        }
        remat::keep::op(OpKind::Conv, |kept| match crate::fused::generic(x) {
            true => crate::fused::conv_transpose3d_k2s2_generic(x, w, b, kept),
            false => crate::fused::conv_transpose3d_k2s2(x, w, b, kept),
        })
    })
}

impl ConvCall {
    /// Runs this convolution on `operands` (in call order, of its shapes).
    pub fn call(&self, operands: &[Tensor]) -> Result<Tensor> {
        let (stride_d, stride_hw, pad_d, pad_hw) = self.geometry;
        let g = Conv3dGeometry { stride_d, stride_hw, pad_d, pad_hw };
        match (self.kind, operands) {
            (ConvKind::Conv2d, [x, w]) => conv2d(x, w, pad_hw, stride_hw),
            (ConvKind::Conv3d, [x, w]) => conv3d(x, w, g),
            (ConvKind::Conv3dConcat, [a, b, w]) => conv3d_concat(a, b, w, g),
            (ConvKind::ConvTranspose3dK2S2, [x, w, b]) => conv_transpose3d_k2s2(x, w, b),
            _ => candle_core::bail!("{:?} takes {} operands", self.kind, self.shapes.len()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::testing::{grid, rand};
    use candle_core::Device;

    /// The definition, loop by loop.
    fn conv3d_naive(
        x: &[f32],
        xs: [usize; 5],
        w: &[f32],
        ws: [usize; 5],
        g: Conv3dGeometry,
    ) -> (Vec<f32>, [usize; 5]) {
        let [n, c, d, h, wd] = xs;
        let [o, _, kd, kh, kw] = ws;
        let out = |len: usize, k: usize, s: usize, p: usize| (len + 2 * p - k) / s + 1;
        let (od, oh, ow) = (
            out(d, kd, g.stride_d, g.pad_d),
            out(h, kh, g.stride_hw, g.pad_hw),
            out(wd, kw, g.stride_hw, g.pad_hw),
        );
        let mut y = vec![0f32; n * o * od * oh * ow];
        for (b, oc, z, i, j) in grid(n, o, od, oh, ow) {
            let mut acc = 0f32;
            for ic in 0..c {
                for a in 0..kd {
                    for p in 0..kh {
                        for q in 0..kw {
                            let (zz, ii, jj) = (
                                (z * g.stride_d + a) as isize - g.pad_d as isize,
                                (i * g.stride_hw + p) as isize - g.pad_hw as isize,
                                (j * g.stride_hw + q) as isize - g.pad_hw as isize,
                            );
                            if zz < 0
                                || ii < 0
                                || jj < 0
                                || zz as usize >= d
                                || ii as usize >= h
                                || jj as usize >= wd
                            {
                                continue;
                            }
                            let xv = x[(((b * c + ic) * d + zz as usize) * h + ii as usize) * wd
                                + jj as usize];
                            acc += xv * w[(((oc * c + ic) * kd + a) * kh + p) * kw + q];
                        }
                    }
                }
            }
            y[(((b * o + oc) * od + z) * oh + i) * ow + j] = acc;
        }
        (y, [n, o, od, oh, ow])
    }

    fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= tol * (1.0 + y.abs()), "element {i}: {x} vs {y}");
        }
    }

    #[test]
    fn conv3d_matches_the_definition() -> Result<()> {
        let cases = [
            ([2, 3, 5, 6, 6], [4, 3, 3, 3, 3], Conv3dGeometry::same(3)),
            (
                [1, 2, 7, 5, 5],
                [3, 2, 3, 3, 3],
                Conv3dGeometry { stride_d: 2, stride_hw: 2, pad_d: 1, pad_hw: 1 },
            ),
            (
                [1, 2, 4, 5, 7],
                [2, 2, 2, 1, 3],
                Conv3dGeometry { stride_d: 1, stride_hw: 1, pad_d: 0, pad_hw: 0 },
            ),
        ];
        for (xs, ws, g) in cases {
            let (x, w) = (rand("x", &xs), rand("w", &ws));
            let (want, ys) = conv3d_naive(&x, xs, &w, ws, g);
            let got = conv3d(
                &Tensor::from_vec(x, &xs, &Device::Cpu)?,
                &Tensor::from_vec(w, &ws, &Device::Cpu)?,
                g,
            )?;
            assert_eq!(got.dims(), ys, "{xs:?} {ws:?} {g:?}");
            close(&got.flatten_all()?.to_vec1::<f32>()?, &want, 1e-5);
        }
        Ok(())
    }

    /// The fused kernel and the composed fallback (what runs on a GPU) agree, forward and backward,
    /// strided (the input gradient scattered back from the column matrix's) and not (a
    /// convolution of the output gradient).
    #[test]
    fn fused_and_composed_conv3d_agree() -> Result<()> {
        for g in [
            Conv3dGeometry { stride_d: 2, stride_hw: 1, pad_d: 1, pad_hw: 1 },
            Conv3dGeometry::same(3),
        ] {
            let x = candle_core::Var::from_vec(
                rand("x", &[2, 3, 5, 6, 6]),
                (2, 3, 5, 6, 6),
                &Device::Cpu,
            )?;
            let w = candle_core::Var::from_vec(
                rand("w", &[4, 3, 3, 3, 3]),
                (4, 3, 3, 3, 3),
                &Device::Cpu,
            )?;
            let d_out = if g.stride_d == 2 { 3 } else { 5 };
            let r = Tensor::from_vec(
                rand("r", &[2, 4, d_out, 6, 6]),
                (2, 4, d_out, 6, 6),
                &Device::Cpu,
            )?;
            type Conv<'a> = dyn Fn(&Tensor, &Tensor, Conv3dGeometry) -> Result<Tensor> + 'a;
            let run = |f: &Conv<'_>| -> Result<Vec<Vec<f32>>> {
                let y = f(x.as_tensor(), w.as_tensor(), g)?;
                let grads = (&y * &r)?.sum_all()?.backward()?;
                let (dx, dw) = (grads.get(&x).unwrap().clone(), grads.get(&w).unwrap().clone());
                [y, dx, dw].iter().map(|t| t.flatten_all()?.to_vec1::<f32>()).collect()
            };
            let composed = run(&conv3d_composed)?;
            // Blocks of both samples side by side, of one output row, of one whole sample.
            for entries in [1 << 21, 1, 81 * 5 * 36] {
                let fused = run(&|x, w, g| crate::fused::conv3d_blocked(x, w, g, entries))?;
                for (fused, composed) in fused.iter().zip(&composed) {
                    close(fused, composed, 1e-5);
                }
            }
        }
        Ok(())
    }

    /// The convolution of two tensors' channels side by side gives the bits of the convolution of
    /// their concatenation, forward and backward, in both layouts (few channels: the column
    /// matrix; eight or more: the patch matrix), strided or not, pointwise.
    #[test]
    fn conv3d_concat_is_conv3d_of_the_concatenation() -> Result<()> {
        let strided = Conv3dGeometry { stride_d: 2, stride_hw: 2, pad_d: 1, pad_hw: 1 };
        let pointwise = Conv3dGeometry { stride_d: 1, stride_hw: 1, pad_d: 0, pad_hw: 0 };
        for ((ca, cb), k, g) in [
            ((3, 6), 3, Conv3dGeometry::same(3)),
            ((1, 2), 3, Conv3dGeometry::same(3)),
            ((4, 5), 3, strided),
            ((3, 6), 1, pointwise),
        ] {
            let var = |name: &str, shape: &[usize]| {
                candle_core::Var::from_vec(rand(name, shape), shape, &Device::Cpu)
            };
            let (a, b, w) = (
                var("a", &[2, ca, 5, 6, 6])?,
                var("b", &[2, cb, 5, 6, 6])?,
                var("w", &[4, ca + cb, k, k, k])?,
            );
            let y = conv3d(&Tensor::cat(&[a.as_tensor(), b.as_tensor()], 1)?, w.as_tensor(), g)?;
            let r = Tensor::from_vec(rand("r", y.dims()), y.shape(), &Device::Cpu)?;
            let run = |y: Tensor| -> Result<Vec<Vec<f32>>> {
                let grads = (&y * &r)?.sum_all()?.backward()?;
                let mut out = vec![y.flatten_all()?.to_vec1::<f32>()?];
                for v in [&a, &b, &w] {
                    out.push(grads.get(v).expect("a gradient").flatten_all()?.to_vec1::<f32>()?);
                }
                Ok(out)
            };
            let concat = run(conv3d_concat(a.as_tensor(), b.as_tensor(), w.as_tensor(), g)?)?;
            assert_eq!(concat, run(y)?, "{ca} + {cb} channels, {g:?}");
        }
        Ok(())
    }

    #[test]
    fn transposed_conv_matches_the_definition() -> Result<()> {
        let (xs, ws) = ([2, 3, 2, 3, 2], [3, 4, 2, 2, 2]);
        let (x, w) = (rand("x", &xs), rand("w", &ws));
        let bias = rand("b", &[4]);
        let (xt, wt, bt) = (
            Tensor::from_vec(x.clone(), &xs, &Device::Cpu)?,
            Tensor::from_vec(w.clone(), &ws, &Device::Cpu)?,
            Tensor::from_vec(bias.clone(), 4, &Device::Cpu)?,
        );
        for f in [conv_transpose3d_k2s2, conv_transpose3d_k2s2_composed] {
            let got = f(&xt, &wt, &bt)?;
            assert_eq!(got.dims(), [2, 4, 4, 6, 4]);
            let got = got.flatten_all()?.to_vec1::<f32>()?;
            for (b, oc, z, i, j) in grid(2, 4, 4, 6, 4) {
                let want: f32 = bias[oc]
                    + (0..3)
                        .map(|c| {
                            x[(((b * 3 + c) * 2 + z / 2) * 3 + i / 2) * 2 + j / 2]
                                * w[(((c * 4 + oc) * 2 + z % 2) * 2 + i % 2) * 2 + j % 2]
                        })
                        .sum::<f32>();
                let at = (((b * 4 + oc) * 4 + z) * 6 + i) * 4 + j;
                assert!((got[at] - want).abs() < 1e-5, "{:?}", (b, oc, z, i, j));
            }
        }
        Ok(())
    }
}
