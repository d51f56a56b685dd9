use candle_core::{Result, Tensor};

/// Max-pooling with kernel 3, stride 2, padding 1 over the last two dims (the ResNet stem pool):
/// the fused kernel on the CPU in f32/f64 (keeps only its input), elsewhere composed from ops that
/// have a backward (candle's `max_pool2d` backward is only right when kernel == stride), as one op
/// on the generic route (it keeps only its input).
pub fn max_pool2d_k3s2p1(x: &Tensor) -> Result<Tensor> {
    if crate::fused::generic(x) {
        return crate::fused::max_pool_generic(x, composed);
    }
    if crate::fused::fused(x) {
        return crate::fused::max_pool2d(x, 3, 2, 1);
    }
    composed(x)
}

/// Max is separable: pools the rows, then the columns.
pub(crate) fn composed(x: &Tensor) -> Result<Tensor> {
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

#[cfg(test)]
mod tests {
    use super::*;
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
            for pool in [max_pool2d_k3s2p1, composed] {
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
        assert_eq!(run(max_pool2d_k3s2p1)?, run(composed)?);
        Ok(())
    }
}
