//! The layers a model calls against central finite differences in f64, every input and weight;
//! and the rules finite differences cannot see: BatchNorm's running statistics, dropout's mask
//! replay. Not here: the fused ops called directly (`fused_ops`).

use super::{check_gradients, distinct, normal, output_and_gradients, randomised, refs};
use candle_core::{DType, Device, Result, Tensor};
use ops::{
    conv3d, conv3d_concat, conv_transpose3d_k2s2, dropout, fused, max_pool2d_k3s2p1,
    max_pool3d_k2s2, BatchNorm, Conv3dGeometry, GroupNorm, LayerNorm,
};
use params::ParamStore;
use remat::rng::RngKey;
use remat::StageCtx;

#[test]
fn conv3d_input_and_weight() -> Result<()> {
    crate::route();
    let cases = [
        (
            [1, 2, 5, 5, 5],
            [3, 2, 3, 3, 3],
            Conv3dGeometry { stride_d: 2, stride_hw: 2, pad_d: 1, pad_hw: 1 },
        ),
        ([2, 2, 3, 4, 4], [2, 2, 3, 3, 3], Conv3dGeometry::same(3)),
        (
            [1, 3, 4, 3, 5],
            [2, 3, 2, 1, 3],
            Conv3dGeometry { stride_d: 1, stride_hw: 1, pad_d: 0, pad_hw: 0 },
        ),
        // Pointwise: a matrix product per sample, nothing built.
        (
            [2, 3, 2, 3, 4],
            [4, 3, 1, 1, 1],
            Conv3dGeometry { stride_d: 1, stride_hw: 1, pad_d: 0, pad_hw: 0 },
        ),
        // Strided pointwise: the pointwise convolution of every stride-th voxel, odd sides.
        (
            [2, 3, 5, 5, 5],
            [4, 3, 1, 1, 1],
            Conv3dGeometry { stride_d: 2, stride_hw: 2, pad_d: 0, pad_hw: 0 },
        ),
    ];
    for (xs, ws, g) in cases {
        let (x, w) = (normal("x", &xs, 0.0, 1.0)?, normal("w", &ws, 0.0, 1.0)?);
        check_gradients(&format!("conv3d {xs:?} {ws:?}"), &[("x", &x), ("w", &w)], || {
            conv3d(x.as_tensor(), w.as_tensor(), g)
        })?;
    }
    Ok(())
}

/// The convolution of two tensors' channels side by side (the U-Net decoder's skip and up-sampled
/// tensors): 3 + 6 channels take the patch matrix, 1 + 2 the column matrix.
#[test]
fn conv3d_concat_inputs_and_weight() -> Result<()> {
    crate::route();
    for (ca, cb) in [(3, 6), (1, 2)] {
        let (a, b) =
            (normal("a", &[2, ca, 3, 4, 4], 0.0, 1.0)?, normal("b", &[2, cb, 3, 4, 4], 0.0, 1.0)?);
        let w = normal("w", &[2, ca + cb, 3, 3, 3], 0.0, 1.0)?;
        let vars = [("a", &a), ("b", &b), ("w", &w)];
        check_gradients(&format!("conv3d_concat {ca} + {cb}"), &vars, || {
            conv3d_concat(a.as_tensor(), b.as_tensor(), w.as_tensor(), Conv3dGeometry::same(3))
        })?;
    }
    Ok(())
}

/// conv2d (the fused 3D kernel at depth 1), the ResNet geometries: the 7x7/2 stem, 3x3, a 1x1
/// and a strided 1x1, on odd and even sides; and against candle's own conv2d.
#[test]
fn conv2d_input_and_weight() -> Result<()> {
    crate::route();
    let cases = [
        ([1, 3, 9, 9], [2, 3, 7, 7], 3, 2),
        ([2, 2, 5, 6], [3, 2, 3, 3], 1, 1),
        ([2, 4, 3, 5], [3, 4, 1, 1], 0, 1),
        ([1, 4, 6, 6], [2, 4, 1, 1], 0, 2),
        ([2, 3, 7, 5], [2, 3, 1, 1], 0, 2),
    ];
    for (xs, ws, pad, stride) in cases {
        let (x, w) = (normal("x", &xs, 0.0, 1.0)?, normal("w", &ws, 0.0, 1.0)?);
        check_gradients(&format!("conv2d {xs:?} {ws:?}"), &[("x", &x), ("w", &w)], || {
            ops::conv2d(x.as_tensor(), w.as_tensor(), pad, stride)
        })?;
        let diff = (ops::conv2d(x.as_tensor(), w.as_tensor(), pad, stride)?
            - x.as_tensor().conv2d(w.as_tensor(), pad, stride, 1, 1)?)?;
        assert!(
            diff.abs()?.max_all()?.to_scalar::<f64>()? < 1e-12,
            "conv2d {xs:?} {ws:?} differs from candle's"
        );
    }
    Ok(())
}

/// The fused embedding's table gradient (ids repeat, so rows add up) and its rows.
#[test]
fn embedding_table() -> Result<()> {
    crate::route();
    let table = normal("table", &[7, 4], 0.0, 1.0)?;
    let ids = Tensor::from_vec(vec![3u32, 0, 3, 6, 1, 3], (2, 3), &Device::Cpu)?;
    check_gradients("embedding", &[("table", &table)], || {
        fused::embedding(table.as_tensor(), &ids)
    })?;
    let composed = table.as_tensor().index_select(&ids.flatten_all()?, 0)?.reshape((2, 3, 4))?;
    assert_eq!(
        fused::embedding(table.as_tensor(), &ids)?.flatten_all()?.to_vec1::<f64>()?,
        composed.flatten_all()?.to_vec1::<f64>()?
    );
    assert!(
        fused::embedding(table.as_tensor(), &Tensor::new(&[7u32], &Device::Cpu)?).is_err(),
        "an id outside the table must fail"
    );
    Ok(())
}

/// BatchNorm + residual add + ReLU (a ResNet block's end): input, residual, weight and bias.
#[test]
fn batch_norm_add_relu() -> Result<()> {
    crate::route();
    let mut params = ParamStore::new(&Device::Cpu, DType::F64, 0);
    let bn = BatchNorm::new(&mut params, "bn", 3)?;
    let named = randomised(&params)?;
    let (x, r) = (normal("x", &[2, 3, 4, 5], -1.0, 3.0)?, normal("r", &[2, 3, 4, 5], 0.0, 1.0)?);
    let mut vars = refs(&named);
    vars.extend([("x", &x), ("r", &r)]);
    let ctx = StageCtx::new(remat::RunPoint { recompute: true, train: true, ..Default::default() });
    let pre =
        (bn.forward(x.as_tensor(), &ctx)? + r.as_tensor())?.flatten_all()?.to_vec1::<f64>()?;
    assert!(pre.iter().all(|v| v.abs() > 1e-4), "an input sits on the ReLU's kink");
    check_gradients("fused BatchNorm + add + ReLU", &vars, || {
        bn.forward_add_relu(x.as_tensor(), r.as_tensor(), &ctx)
    })
}

/// Two BatchNorms added and a ReLU (a downsampling block's end) as one op: both inputs and all
/// four parameters; and the same bits, forward and backward, as the second BatchNorm's output
/// passed as the first's residual.
#[test]
fn batch_norm_pair_relu() -> Result<()> {
    crate::route();
    let mut params = ParamStore::new(&Device::Cpu, DType::F64, 0);
    let (bn, other) =
        (BatchNorm::new(&mut params, "bn", 3)?, BatchNorm::new(&mut params, "other", 3)?);
    let named = randomised(&params)?;
    let (x, x2) = (normal("x", &[2, 3, 4, 5], -1.0, 3.0)?, normal("x2", &[2, 3, 4, 5], 0.5, 2.0)?);
    let mut vars = refs(&named);
    vars.extend([("x", &x), ("x2", &x2)]);
    let ctx = StageCtx::new(remat::RunPoint { recompute: true, train: true, ..Default::default() });
    let composed =
        || bn.forward_add_relu(x.as_tensor(), &other.forward(x2.as_tensor(), &ctx)?, &ctx);
    let pre = (bn.forward(x.as_tensor(), &ctx)? + other.forward(x2.as_tensor(), &ctx)?)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    assert!(pre.iter().all(|v| v.abs() > 1e-4), "an input sits on the ReLU's kink");
    let pair = || bn.forward_pair_relu(x.as_tensor(), &other, x2.as_tensor(), &ctx);
    check_gradients("fused BatchNorm pair + ReLU", &vars, pair)?;
    assert_eq!(
        output_and_gradients(&vars, &pair)?,
        output_and_gradients(&vars, &composed)?,
        "the pair op and its composition differ"
    );
    Ok(())
}

/// A convolution of a BatchNorm + ReLU's output as one op (inside a ResNet bottleneck): input,
/// both BatchNorm parameters and the convolution's weight, against finite differences, for a 3x3
/// kernel, a strided one and a 1x1; and the same bits, forward and backward, in f64 and f32, as
/// the two ops; the running statistics updated as the two ops update them. (On the generic
/// route the layer composes the two ops: the same checks hold trivially.)
#[test]
fn batch_norm_relu_conv() -> Result<()> {
    crate::route();
    for (k, stride) in [(3, 1), (3, 2), (1, 1)] {
        let mut params = ParamStore::new(&Device::Cpu, DType::F64, 0);
        let bn = BatchNorm::new(&mut params, "bn", 3)?;
        let named = randomised(&params)?;
        let (x, w) =
            (normal("x", &[2, 3, 6, 4], -1.0, 3.0)?, normal("w", &[4, 3, k, k], 0.0, 1.0)?);
        let mut vars = refs(&named);
        vars.extend([("x", &x), ("w", &w)]);
        let ctx =
            StageCtx::new(remat::RunPoint { recompute: true, train: true, ..Default::default() });
        let pre = bn.forward(x.as_tensor(), &ctx)?.flatten_all()?.to_vec1::<f64>()?;
        assert!(pre.iter().all(|v| v.abs() > 1e-4), "an input sits on the ReLU's kink");
        let (pad, what) = (k / 2, format!("BatchNorm + ReLU + {k}x{k}/{stride} conv"));
        let one_op = || bn.forward_relu_conv2d(x.as_tensor(), w.as_tensor(), pad, stride, &ctx);
        check_gradients(&what, &vars, one_op)?;
        let two_ops = || {
            let y = bn.forward_relu(x.as_tensor(), &ctx)?;
            ops::conv2d(&y, w.as_tensor(), pad, stride)
        };
        assert_eq!(
            output_and_gradients(&vars, &one_op)?,
            output_and_gradients(&vars, &two_ops)?,
            "{what}: f64"
        );
        // In f32, the direct kernels' precision: the same bits too.
        let f32_var =
            |v: &candle_core::Var| candle_core::Var::from_tensor(&v.to_dtype(DType::F32)?);
        let (x, w) = (f32_var(&x)?, f32_var(&w)?);
        let mut params = ParamStore::new(&Device::Cpu, DType::F32, 0);
        let bn = BatchNorm::new(&mut params, "bn", 3)?;
        let named = randomised(&params)?;
        let mut vars = refs(&named);
        vars.extend([("x", &x), ("w", &w)]);
        let one_op = || bn.forward_relu_conv2d(x.as_tensor(), w.as_tensor(), pad, stride, &ctx);
        let two_ops =
            || ops::conv2d(&bn.forward_relu(x.as_tensor(), &ctx)?, w.as_tensor(), pad, stride);
        assert_eq!(
            output_and_gradients(&vars, &one_op)?,
            output_and_gradients(&vars, &two_ops)?,
            "{what}: f32"
        );
    }
    // Outside a recompute both update the running statistics, alike.
    let train = StageCtx::new(remat::RunPoint { train: true, ..Default::default() });
    let stats = |one_op: bool| -> Result<Vec<Vec<f32>>> {
        let mut params = ParamStore::new(&Device::Cpu, DType::F64, 0);
        let bn = BatchNorm::new(&mut params, "bn", 3)?;
        let (x, w) =
            (normal("x", &[2, 3, 5, 4], -1.0, 3.0)?, normal("w", &[4, 3, 1, 1], 0.0, 1.0)?);
        match one_op {
            true => bn.forward_relu_conv2d(x.as_tensor(), w.as_tensor(), 0, 1, &train)?,
            false => ops::conv2d(&bn.forward_relu(x.as_tensor(), &train)?, w.as_tensor(), 0, 1)?,
        };
        let (mean, var) = bn.running_stats();
        Ok(vec![mean.to_vec1::<f32>()?, var.to_vec1::<f32>()?])
    };
    let (once, twice) = (stats(true)?, stats(false)?);
    assert_ne!(once[0], vec![0.0; 3], "the running mean was not updated");
    assert_eq!(once, twice, "the running statistics differ");
    Ok(())
}

#[test]
fn transposed_conv3d_input_and_weight() -> Result<()> {
    crate::route();
    let (x, w, b) = (
        normal("x", &[2, 3, 1, 3, 2], 0.0, 1.0)?,
        normal("w", &[3, 2, 2, 2, 2], 0.0, 1.0)?,
        normal("b", &[2], 0.0, 1.0)?,
    );
    check_gradients("conv_transpose3d_k2s2", &[("x", &x), ("w", &w), ("b", &b)], || {
        conv_transpose3d_k2s2(x.as_tensor(), w.as_tensor(), b.as_tensor())
    })
}

#[test]
fn pools() -> Result<()> {
    crate::route();
    // Odd sizes: the last slice of depth and width is dropped.
    let x = distinct("pool3d", &[1, 2, 5, 4, 7])?;
    check_gradients("max_pool3d_k2s2", &[("x", &x)], || max_pool3d_k2s2(x.as_tensor()))?;
    let x = distinct("pool2d", &[2, 2, 7, 6])?;
    check_gradients("max_pool2d_k3s2p1", &[("x", &x)], || max_pool2d_k3s2p1(x.as_tensor()))
}

#[test]
fn layer_norm_input_weight_and_bias() -> Result<()> {
    crate::route();
    let mut params = ParamStore::new(&Device::Cpu, DType::F64, 0);
    let ln = LayerNorm::new(&mut params, "ln", 5, 1e-5)?;
    let named = randomised(&params)?;
    let x = normal("x", &[2, 3, 5], 0.5, 2.0)?;
    let mut vars = refs(&named);
    vars.push(("x", &x));
    check_gradients("LayerNorm", &vars, || ln.forward(x.as_tensor()))?;

    // Forward by hand: (x - mean) / sqrt(biased var + eps) * weight + bias, per row.
    let y = ln.forward(x.as_tensor())?.flatten_all()?.to_vec1::<f64>()?;
    let xs = x.as_tensor().flatten_all()?.to_vec1::<f64>()?;
    // Name order: bias, weight.
    let (w, b) =
        (named[1].1.as_tensor().to_vec1::<f64>()?, named[0].1.as_tensor().to_vec1::<f64>()?);
    for (row, out) in xs.chunks(5).zip(y.chunks(5)) {
        let mean = row.iter().sum::<f64>() / 5.0;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 5.0;
        for j in 0..5 {
            let want = (row[j] - mean) / (var + 1e-5f32 as f64).sqrt() * w[j] + b[j];
            assert!((out[j] - want).abs() < 1e-12, "LayerNorm forward: {} vs {want}", out[j]);
        }
    }
    Ok(())
}

#[test]
fn group_norm_input_weight_and_bias() -> Result<()> {
    crate::route();
    let mut params = ParamStore::new(&Device::Cpu, DType::F64, 0);
    let gn = GroupNorm::new(&mut params, "gn", 6, 3)?;
    let named = randomised(&params)?;
    let x = normal("x", &[2, 6, 3, 1, 3], 1.0, 2.0)?;
    let mut vars = refs(&named);
    vars.push(("x", &x));
    check_gradients("GroupNorm", &vars, || gn.forward(x.as_tensor()))
}

/// PyTorch's rule: normalise with the biased batch variance; running_mean = 0.9 running_mean +
/// 0.1 batch mean, running_var = 0.9 running_var + 0.1 unbiased batch variance; once per step
/// (never while recomputing); evaluation normalises with the running statistics.
#[test]
fn batch_norm_running_statistics_follow_pytorch() -> Result<()> {
    crate::route();
    let (n, c, hw) = (3, 2, 4);
    let mut params = ParamStore::new(&Device::Cpu, DType::F32, 0);
    let bn = BatchNorm::new(&mut params, "bn", c)?;
    let xs = RngKey::named(5, "x").normal(n * c * hw, 2.0, 3.0);
    let x = Tensor::from_vec(xs.clone(), (n, c, 2, 2), &Device::Cpu)?;
    let xs_ref = &xs;
    let per_channel = |ch: usize| -> Vec<f64> {
        (0..n).flat_map(|b| (0..hw).map(move |i| xs_ref[(b * c + ch) * hw + i] as f64)).collect()
    };
    let mut want_mean = [0f64; 2];
    let mut want_var = [1f64; 2];
    for step in 0..2 {
        bn.forward(
            &x,
            &StageCtx::new(remat::RunPoint { step, train: true, ..Default::default() }),
        )?;
        bn.forward(
            &x,
            &StageCtx::new(remat::RunPoint {
                step,
                recompute: true,
                train: true,
                ..Default::default()
            }),
        )?; // a recompute: no update
        for ch in 0..c {
            let v = per_channel(ch);
            let m = v.iter().sum::<f64>() / v.len() as f64;
            let unbiased = v.iter().map(|a| (a - m).powi(2)).sum::<f64>() / (v.len() - 1) as f64;
            want_mean[ch] = 0.9 * want_mean[ch] + 0.1 * m;
            want_var[ch] = 0.9 * want_var[ch] + 0.1 * unbiased;
        }
        let (mean, var) = bn.running_stats();
        for (got, want) in [(mean, want_mean), (var, want_var)] {
            for (g, w) in got.to_vec1::<f32>()?.iter().zip(want) {
                assert!(
                    (*g as f64 - w).abs() < 1e-5 * (1.0 + w.abs()),
                    "step {step}: running statistic {g}, PyTorch's rule gives {w}"
                );
            }
        }
    }
    let y = bn.forward(&x, &StageCtx::eval())?.flatten_all()?.to_vec1::<f32>()?;
    for (i, (&out, &inp)) in y.iter().zip(&xs).enumerate() {
        let ch = (i / hw) % c;
        let want = (inp as f64 - want_mean[ch]) / (want_var[ch] + 1e-5).sqrt(); // weight 1, bias 0
        assert!((out as f64 - want).abs() < 1e-5, "evaluation: {out} vs {want}");
    }
    Ok(())
}

#[test]
fn dropout_gradient_is_the_replayed_mask() -> Result<()> {
    crate::route();
    let x = normal("x", &[3, 7], 0.0, 1.0)?;
    let ctx = |recompute| {
        StageCtx::new(remat::RunPoint {
            seed: 1,
            step: 2,
            stage: 3,
            recompute,
            train: true,
            ..Default::default()
        })
    };
    // A fresh context per evaluation: the same key, as a recompute gets.
    check_gradients("dropout", &[("x", &x)], || dropout(x.as_tensor(), 0.3, &ctx(false)))?;
    let grad = |recompute| -> Result<Vec<u64>> {
        let g = dropout(x.as_tensor(), 0.3, &ctx(recompute))?.sum_all()?.backward()?;
        Ok(g.get(&x)
            .unwrap()
            .flatten_all()?
            .to_vec1::<f64>()?
            .into_iter()
            .map(f64::to_bits)
            .collect())
    };
    let forward = grad(false)?;
    assert_eq!(forward, grad(true)?, "the recompute must replay the forward's mask");
    let kept = forward.iter().filter(|&&b| f64::from_bits(b) != 0.0).count();
    assert!(
        kept > 0 && kept < forward.len(),
        "some elements dropped, some kept: {kept} of {}",
        forward.len()
    );
    assert!(
        forward
            .iter()
            .map(|&b| f64::from_bits(b))
            .all(|g| g == 0.0 || (g - 1.0 / 0.7).abs() < 1e-6),
        "kept elements scale by 1 / (1 - p)"
    );
    Ok(())
}
