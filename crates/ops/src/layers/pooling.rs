//! The max-pooling layers a model calls: ResNet's stem pool (kernel 3, stride 2, padding 1, over
//! two dims) and the U-Net's (kernel = stride = 2, over three), with a correct backward (candle's
//! is only right where kernel == stride) that keeps only the input: the fused kernel on the CPU
//! and the generic route, elsewhere composed from ops that have a backward. Not here: the kernel
//! (`fused::max_pool`).

use candle_core::{Result, Tensor};

/// Max-pooling with kernel 3, stride 2, padding 1 over the last two dims (the ResNet stem pool):
/// the fused kernel on the CPU in f32/f64 (keeps only its input), elsewhere composed from ops that
/// have a backward (candle's `max_pool2d` backward is only right when kernel == stride), as one op
/// on the generic route (it keeps only its input).
pub fn max_pool2d_k3s2p1(x: &Tensor) -> Result<Tensor> {
    if crate::fused::generic(x) {
        return crate::fused::max_pool_generic(x, max_pool2d_k3s2p1_composed);
    }
    if crate::fused::fused(x) {
        return crate::fused::max_pool2d(x, 3, 2, 1);
    }
    max_pool2d_k3s2p1_composed(x)
}

/// [`max_pool2d_k3s2p1`] composed: max is separable, so it pools the rows, then the columns.
fn max_pool2d_k3s2p1_composed(x: &Tensor) -> Result<Tensor> {
    let r = x.rank();
    pool_axis_k3s2p1(&pool_axis_k3s2p1(x, r - 2)?, r - 1)
}

/// Windows `[2i-1, 2i+1]` along `axis`, padded with -inf: output length `ceil(n / 2)`. Window i is
/// the pair (2i-1, 2i) of the padded axis plus the element after it.
fn pool_axis_k3s2p1(x: &Tensor, axis: usize) -> Result<Tensor> {
    let n = x.dim(axis)?;
    let out = n.div_ceil(2);
    let pad = |len: usize| -> Result<Tensor> {
        let mut shape = x.dims().to_vec();
        shape[axis] = len;
        Tensor::full(f32::NEG_INFINITY, shape, x.device())?.to_dtype(x.dtype())
    };
    // Padded to 2 * out + 2 elements: one -inf in front, one or two behind.
    let padded = Tensor::cat(&[&pad(1)?, x, &pad(2 * out + 1 - n)?], axis)?;
    let pairs = |start: usize| -> Result<Tensor> {
        let mut shape = x.dims().to_vec();
        shape[axis] = out;
        shape.insert(axis + 1, 2);
        padded.narrow(axis, start, 2 * out)?.reshape(shape)
    };
    let first_two = pairs(0)?.max(axis + 1)?; // max(P[2i], P[2i+1])
    let third = pairs(2)?.narrow(axis + 1, 0, 1)?.squeeze(axis + 1)?; // P[2i+2]
    first_two.maximum(&third)
}

/// Max-pooling with kernel = stride = 2 over the last three dims (odd sizes are floored, as in
/// PyTorch): the fused kernel on the CPU in f32/f64 and on the generic route (each keeps only its
/// input), elsewhere a reshape and three maxima (which keep the partial maxima: 7/8 of the input's
/// size).
pub fn max_pool3d_k2s2(x: &Tensor) -> Result<Tensor> {
    x.dims5()?;
    if crate::fused::generic(x) {
        return crate::fused::max_pool_generic(x, max_pool3d_k2s2_composed);
    }
    if crate::fused::fused(x) {
        return crate::fused::max_pool3d(x, 2, 2, 0);
    }
    max_pool3d_k2s2_composed(x)
}

/// [`max_pool3d_k2s2`] composed: a reshape and three maxima.
fn max_pool3d_k2s2_composed(x: &Tensor) -> Result<Tensor> {
    let (n, c, d, h, w) = x.dims5()?;
    let (d2, h2, w2) = (d / 2, h / 2, w / 2);
    if d2 == 0 || h2 == 0 || w2 == 0 {
        candle_core::bail!("max_pool3d_k2s2: input {d}x{h}x{w} is too small to pool")
    }
    let x = x.narrow(2, 0, 2 * d2)?.narrow(3, 0, 2 * h2)?.narrow(4, 0, 2 * w2)?.contiguous()?;
    x.reshape(vec![n, c, d2, 2, h2, 2, w2, 2])?.max(7)?.max(5)?.max(3)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::testing::{grid, rand};
    use candle_core::Device;

    /// Direct definition: every output is the max of its 3x3 window (out-of-range skipped).
    fn naive(x: &[f32], h: usize, w: usize) -> Vec<f32> {
        let (ho, wo) = (h.div_ceil(2), w.div_ceil(2));
        let mut out = vec![f32::NEG_INFINITY; ho * wo];
        for i in 0..ho {
            for j in 0..wo {
                for di in 0..3 {
                    for dj in 0..3 {
                        let (r, c) = ((2 * i + di) as isize - 1, (2 * j + dj) as isize - 1);
                        if r >= 0 && c >= 0 && (r as usize) < h && (c as usize) < w {
                            out[i * wo + j] = out[i * wo + j].max(x[r as usize * w + c as usize]);
                        }
                    }
                }
            }
        }
        out
    }

    fn input(h: usize, w: usize) -> Vec<f32> {
        // Distinct values, so the max of every window is unique (no ties for the gradient).
        remat::rng::RngKey::named(1, "pool")
            .uniform(h * w)
            .into_iter()
            .enumerate()
            .map(|(i, u)| u + i as f32 * 1e-3)
            .collect()
    }

    #[test]
    fn matches_the_direct_definition_for_even_and_odd_sizes() -> Result<()> {
        for (h, w) in [(8, 8), (7, 7), (5, 6), (1, 1), (112, 112)] {
            let x = input(h, w);
            let t = Tensor::from_vec(x.clone(), (1, 1, h, w), &Device::Cpu)?;
            for pool in [max_pool2d_k3s2p1, max_pool2d_k3s2p1_composed] {
                assert_eq!(pool(&t)?.flatten_all()?.to_vec1::<f32>()?, naive(&x, h, w), "{h}x{w}");
            }
        }
        Ok(())
    }

    /// The fused kernel and the composed fallback (what runs on a GPU) give the same bits, forward
    /// and backward (tie-free input: each window's gradient goes to one element).
    #[test]
    fn fused_and_composed_agree() -> Result<()> {
        let (h, w) = (9, 12);
        let x = candle_core::Var::from_vec(input(h, w).repeat(6), (2, 3, h, w), &Device::Cpu)?;
        let r = Tensor::from_vec(
            remat::rng::RngKey::named(2, "r").normal(2 * 3 * 5 * 6, 0.0, 1.0),
            (2, 3, 5, 6),
            &Device::Cpu,
        )?;
        let run = |pool: fn(&Tensor) -> Result<Tensor>| -> Result<(Vec<f32>, Vec<f32>)> {
            let y = pool(x.as_tensor())?;
            let g = (&y * &r)?
                .sum_all()?
                .backward()?
                .get(&x)
                .expect("a gradient")
                .flatten_all()?
                .to_vec1::<f32>()?;
            Ok((y.flatten_all()?.to_vec1::<f32>()?, g))
        };
        assert_eq!(run(max_pool2d_k3s2p1)?, run(max_pool2d_k3s2p1_composed)?);
        Ok(())
    }

    #[test]
    fn max_pool_matches_the_definition() -> Result<()> {
        let xs = [1, 2, 5, 4, 6]; // odd depth: the last slice is dropped
        let x = rand("x", &xs);
        for pool in [max_pool3d_k2s2, max_pool3d_k2s2_composed] {
            let got = pool(&Tensor::from_vec(x.clone(), &xs, &Device::Cpu)?)?;
            assert_eq!(got.dims(), [1, 2, 2, 2, 3]);
            let got = got.flatten_all()?.to_vec1::<f32>()?;
            for (_, c, z, i, j) in grid(1, 2, 2, 2, 3) {
                let want = grid(1, 1, 2, 2, 2)
                    .map(|(_, _, a, p, q)| x[((c * 5 + 2 * z + a) * 4 + 2 * i + p) * 6 + 2 * j + q])
                    .fold(f32::NEG_INFINITY, f32::max);
                assert_eq!(got[((c * 2 + z) * 2 + i) * 3 + j], want);
            }
        }
        Ok(())
    }

    /// The fused kernel and the composed fallback give the same bits, forward and backward (the
    /// random input has no ties: each window's gradient goes to one element).
    #[test]
    fn fused_and_composed_max_pool3d_agree() -> Result<()> {
        let xs = [2, 3, 5, 6, 7];
        let x = candle_core::Var::from_vec(rand("x", &xs), &xs, &Device::Cpu)?;
        let r = Tensor::from_vec(rand("r", &[2, 3, 2, 3, 3]), (2, 3, 2, 3, 3), &Device::Cpu)?;
        let run = |pool: fn(&Tensor) -> Result<Tensor>| -> Result<(Vec<f32>, Vec<f32>)> {
            let y = pool(x.as_tensor())?;
            let g = (&y * &r)?
                .sum_all()?
                .backward()?
                .get(&x)
                .expect("a gradient")
                .flatten_all()?
                .to_vec1::<f32>()?;
            Ok((y.flatten_all()?.to_vec1::<f32>()?, g))
        };
        assert_eq!(run(max_pool3d_k2s2)?, run(max_pool3d_k2s2_composed)?);
        Ok(())
    }
}
