//! Every layer of this crate against central finite differences in f64: the gradient of every input
//! *and* every weight, on odd shapes, non-trivial affine parameters, and BatchNorm in training
//! mode. Plus the rules finite differences cannot see: BatchNorm's running statistics and dropout's
//! mask replay.
//!
//! Tolerance: with step h = 1e-6 in f64 the central difference is off by O(h^2 f''') ~ 1e-12 from
//! truncation and ~ 1e-16 |f| / h = 1e-10 |f| from rounding, so `|fd - backward| <= 1e-6 (1 +
//! |fd|)` leaves four orders of magnitude of slack and still catches a gradient off by 1e-5
//! relative.

use candle_core::{DType, Device, Result, Tensor, Var};
use ops::{
    conv3d, conv3d_concat, conv_transpose3d_k2s2, dropout, fused, max_pool2d_k3s2p1,
    max_pool3d_k2s2, BatchNorm, Conv3dGeometry, GroupNorm, LayerNorm,
};
use params::ParamStore;
use remat::rng::RngKey;
use remat::StageCtx;

const H: f64 = 1e-6;
const TOL: f64 = 1e-6;

fn normal(name: &str, shape: &[usize], mean: f32, std: f32) -> Result<Var> {
    let v = RngKey::named(11, name).normal(shape.iter().product(), mean, std);
    Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(DType::F64)?)
}

/// Distinct values spaced far more than `H` apart in random order: no ties, so max-pooling is
/// differentiable at the point and a perturbation never changes which element wins.
fn distinct(name: &str, shape: &[usize]) -> Result<Var> {
    let n: usize = shape.iter().product();
    let u = RngKey::named(12, name).uniform(n);
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| u[a].total_cmp(&u[b]));
    let mut v = vec![0f64; n];
    for (rank, &i) in order.iter().enumerate() {
        v[i] = rank as f64 * 0.01 - n as f64 * 0.005;
    }
    Var::from_vec(v, shape, &Device::Cpu)
}

/// The loss `sum(f() * r)` for a fixed random `r`, so every output element weighs differently.
fn weighted_sum(f: &dyn Fn() -> Result<Tensor>) -> Result<Tensor> {
    let y = f()?;
    let r = RngKey::named(13, "r").normal(y.elem_count(), 0.0, 1.0);
    let r = Tensor::from_vec(r, y.shape(), y.device())?.to_dtype(DType::F64)?;
    (y * r)?.sum_all()
}

/// The backward gradient of every element of every var in `vars` against central differences.
fn check_gradients(
    what: &str,
    vars: &[(&str, &Var)],
    f: impl Fn() -> Result<Tensor>,
) -> Result<()> {
    let grads = weighted_sum(&f)?.backward()?;
    for (name, var) in vars {
        assert_eq!(var.dtype(), DType::F64, "{what}: `{name}` must be f64");
        let g = grads
            .get(var)
            .unwrap_or_else(|| panic!("{what}: `{name}` got no gradient"))
            .flatten_all()?
            .to_vec1::<f64>()?;
        let x0 = var.as_tensor().flatten_all()?.to_vec1::<f64>()?;
        let at = |i: usize, delta: f64| -> Result<f64> {
            let mut x = x0.clone();
            x[i] += delta;
            var.set(&Tensor::from_vec(x, var.shape(), var.device())?)?;
            weighted_sum(&f)?.to_scalar::<f64>()
        };
        for (i, &backward) in g.iter().enumerate() {
            let fd = (at(i, H)? - at(i, -H)?) / (2.0 * H);
            assert!(
                (fd - backward).abs() <= TOL * (1.0 + fd.abs()),
                "{what}: d/d{name}[{i}]: finite difference {fd}, backward {backward}"
            );
        }
        var.set(&Tensor::from_vec(x0, var.shape(), var.device())?)?;
    }
    Ok(())
}

/// A parameter store in f64 whose parameters are then set to random values (non-trivial affine).
fn randomised(params: &ParamStore) -> Result<Vec<(String, Var)>> {
    let named: Vec<(String, Var)> =
        params.named().map(|(n, v)| (n.to_string(), v.clone())).collect();
    for (name, var) in &named {
        let mean = if name.ends_with("weight") { 1.0 } else { 0.0 };
        var.set(normal(name, var.dims(), mean, 0.5)?.as_tensor())?;
    }
    Ok(named)
}

fn refs(named: &[(String, Var)]) -> Vec<(&str, &Var)> {
    named.iter().map(|(n, v)| (n.as_str(), v)).collect()
}

#[test]
fn conv3d_input_and_weight() -> Result<()> {
    super::route();
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
    super::route();
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
    super::route();
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
    super::route();
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
    super::route();
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
    super::route();
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
    let bits = |f: &dyn Fn() -> Result<Tensor>| -> Result<Vec<Vec<f64>>> {
        let y = f()?;
        let grads = weighted_sum(&|| Ok(y.clone()))?.backward()?;
        let mut out = vec![y.flatten_all()?.to_vec1::<f64>()?];
        for (_, v) in &vars {
            out.push(
                grads.get(v.as_tensor()).expect("a gradient").flatten_all()?.to_vec1::<f64>()?,
            );
        }
        Ok(out)
    };
    assert_eq!(bits(&pair)?, bits(&composed)?, "the pair op and its composition differ");
    Ok(())
}

#[test]
fn transposed_conv3d_input_and_weight() -> Result<()> {
    super::route();
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
    super::route();
    // Odd sizes: the last slice of depth and width is dropped.
    let x = distinct("pool3d", &[1, 2, 5, 4, 7])?;
    check_gradients("max_pool3d_k2s2", &[("x", &x)], || max_pool3d_k2s2(x.as_tensor()))?;
    let x = distinct("pool2d", &[2, 2, 7, 6])?;
    check_gradients("max_pool2d_k3s2p1", &[("x", &x)], || max_pool2d_k3s2p1(x.as_tensor()))
}

#[test]
fn layer_norm_input_weight_and_bias() -> Result<()> {
    super::route();
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
    super::route();
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
    super::route();
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
    super::route();
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

// Fused ops (`ops::fused`): finite differences, and agreement with the composed candle ops.

#[test]
fn fused_layer_norm_input_weight_and_bias() -> Result<()> {
    super::route();
    let (x, w, b) = (
        normal("x", &[3, 2, 7], 0.5, 2.0)?,
        normal("w", &[7], 1.0, 0.5)?,
        normal("b", &[7], 0.0, 0.5)?,
    );
    check_gradients("fused layer_norm", &[("x", &x), ("w", &w), ("b", &b)], || {
        fused::layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5)
    })
}

#[test]
fn fused_softmax_plain_scaled_and_causal() -> Result<()> {
    super::route();
    let x = normal("x", &[2, 3, 5, 5], 0.0, 2.0)?;
    check_gradients("fused softmax", &[("x", &x)], || {
        fused::softmax_last_dim(x.as_tensor(), 1.0, false)
    })?;
    check_gradients("fused softmax, scaled, causal", &[("x", &x)], || {
        fused::softmax_last_dim(x.as_tensor(), 0.37, true)
    })?;
    let wide = normal("wide", &[4, 9], 0.0, 2.0)?; // not square: rows of one block
    check_gradients("fused softmax, 4x9", &[("x", &wide)], || {
        fused::softmax_last_dim(wide.as_tensor(), 0.5, false)
    })
}

#[test]
fn fused_cross_entropy_plain_and_weighted() -> Result<()> {
    super::route();
    let logits = normal("logits", &[6, 11], 0.0, 3.0)?;
    let targets = Tensor::new(&[0u32, 10, 3, 3, 7, 1], &Device::Cpu)?;
    let weights = Tensor::new(&[1.0f64, 0.0, 1.0, 1.0, 0.0, 1.0], &Device::Cpu)?;
    check_gradients("fused cross_entropy", &[("logits", &logits)], || {
        fused::cross_entropy(logits.as_tensor(), &targets, None)
    })?;
    check_gradients("fused cross_entropy, weighted", &[("logits", &logits)], || {
        fused::cross_entropy(logits.as_tensor(), &targets, Some(&weights))
    })?;
    assert!(
        fused::cross_entropy(
            logits.as_tensor(),
            &Tensor::new(&[11u32, 0, 0, 0, 0, 0], &Device::Cpu)?,
            None
        )
        .is_err(),
        "a target out of range"
    );
    Ok(())
}

/// Each fused op and its composed candle equivalent, forward and backward, in f32: within a few
/// f32 rounding steps of each other (the tolerance is on the scaled error, as the fixtures').
#[test]
fn fused_ops_agree_with_the_composed_candle_ops() -> Result<()> {
    super::route();
    let to32 = |v: &Var| Var::from_tensor(&v.as_tensor().to_dtype(DType::F32)?);
    let x = to32(&normal("x", &[2, 4, 16, 16], 0.0, 3.0)?)?;
    let (w, b) = (to32(&normal("w", &[16], 1.0, 0.5)?)?, to32(&normal("b", &[16], 0.0, 0.5)?)?);
    let targets = Tensor::from_vec((0..32u32).map(|i| (i * 7) % 16).collect(), 32, &Device::Cpu)?;
    let causal = |t: &Tensor| -> Result<Tensor> {
        let mask = Tensor::from_vec(
            (0..256).map(|i| u8::from(i % 16 > i / 16)).collect(),
            (16, 16),
            &Device::Cpu,
        )?;
        let neg_inf = Tensor::new(f32::NEG_INFINITY, &Device::Cpu)?.broadcast_as(t.shape())?;
        mask.broadcast_as(t.shape())?.where_cond(&neg_inf, t)
    };
    type Op<'a> = Box<dyn Fn() -> Result<Tensor> + 'a>;
    let pairs: Vec<(&str, Op, Op)> = vec![
        (
            "layer_norm",
            Box::new(|| fused::layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5)),
            Box::new(|| {
                candle_nn::ops::layer_norm_slow(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5)
            }),
        ),
        (
            "softmax",
            Box::new(|| fused::softmax_last_dim(x.as_tensor(), 0.25, false)),
            Box::new(|| candle_nn::ops::softmax(&(x.as_tensor() * 0.25)?, 3)),
        ),
        (
            "causal softmax",
            Box::new(|| fused::softmax_last_dim(x.as_tensor(), 0.25, true)),
            Box::new(|| candle_nn::ops::softmax(&causal(&(x.as_tensor() * 0.25)?)?, 3)),
        ),
        (
            "cross_entropy",
            Box::new(|| {
                fused::cross_entropy(
                    &x.as_tensor().reshape((128, 16))?.narrow(0, 0, 32)?,
                    &targets,
                    None,
                )
            }),
            Box::new(|| {
                candle_nn::loss::cross_entropy(
                    &x.as_tensor().reshape((128, 16))?.narrow(0, 0, 32)?,
                    &targets,
                )
            }),
        ),
    ];
    for (name, fused_op, composed) in pairs {
        let (a, c) = (fused_op()?, composed()?);
        let err = |p: &Tensor, q: &Tensor| -> Result<f64> {
            let (p, q) = (p.flatten_all()?.to_vec1::<f32>()?, q.flatten_all()?.to_vec1::<f32>()?);
            let scale = q.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
            Ok(p.iter().zip(&q).fold(0f32, |m, (a, b)| m.max((a - b).abs())) as f64 / scale as f64)
        };
        assert!(
            err(&a, &c)? < 1e-5,
            "{name}: forward differs from the composed op by {:.2e}",
            err(&a, &c)?
        );
        let (ga, gc) = (
            weighted_sum(&|| a.to_dtype(DType::F64))?.backward()?,
            weighted_sum(&|| c.to_dtype(DType::F64))?.backward()?,
        );
        for (vname, v) in [("x", &x), ("w", &w), ("b", &b)] {
            if let (Some(p), Some(q)) = (ga.get(v), gc.get(v)) {
                assert!(
                    err(p, q)? < 1e-5,
                    "{name}: gradient of {vname} differs from the composed op's by {:.2e}",
                    err(p, q)?
                );
            } else {
                assert_eq!(
                    ga.get(v).is_some(),
                    gc.get(v).is_some(),
                    "{name}: gradient of {vname} present on one side only"
                );
            }
        }
    }
    Ok(())
}

/// The same inputs give the same bits with 1 and 2 threads, forward and backward: recompute
/// under checkpointing depends on it.
#[test]
fn fused_ops_are_deterministic_across_thread_counts() -> Result<()> {
    super::route();
    let run = |threads: usize| -> Result<Vec<Vec<u32>>> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(candle_core::Error::wrap)?;
        pool.install(|| {
            let x = Var::from_tensor(
                &normal("x", &[300, 64], 0.0, 2.0)?.as_tensor().to_dtype(DType::F32)?,
            )?;
            let w =
                Var::from_tensor(&normal("w", &[64], 1.0, 0.5)?.as_tensor().to_dtype(DType::F32)?)?;
            let b = Var::from_tensor(&Tensor::zeros(64, DType::F32, &Device::Cpu)?)?;
            let targets =
                Tensor::from_vec((0..300u32).map(|i| i % 64).collect(), 300, &Device::Cpu)?;
            let h = fused::layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5)?;
            let p = fused::softmax_last_dim(&h.reshape((3, 100, 64))?, 0.5, false)?
                .reshape((300, 64))?;
            let loss = fused::cross_entropy(&(p * 10.0)?, &targets, None)?;
            // The matrix-product ops (gemm split over the threads), max-pool, BatchNorm + add +
            // ReLU and the embedding, on a small image batch.
            let img = Var::from_tensor(
                &normal("img", &[2, 3, 17, 17], 0.0, 1.0)?.as_tensor().to_dtype(DType::F32)?,
            )?;
            let k = Var::from_tensor(
                &normal("k", &[8, 3, 3, 3], 0.0, 0.5)?.as_tensor().to_dtype(DType::F32)?,
            )?;
            let table = Var::from_tensor(
                &normal("table", &[11, 9], 0.0, 1.0)?.as_tensor().to_dtype(DType::F32)?,
            )?;
            let y = ops::conv2d(img.as_tensor(), k.as_tensor(), 1, 2)?; // (2, 8, 9, 9)
            let mut params = ParamStore::new(&Device::Cpu, DType::F32, 0);
            let bn = BatchNorm::new(&mut params, "bn", 8)?;
            let y = bn.forward_add_relu(
                &y,
                &(&y * 0.5)?,
                &StageCtx::new(remat::RunPoint {
                    recompute: true,
                    train: true,
                    ..Default::default()
                }),
            )?;
            let y = max_pool2d_k3s2p1(&y)?
                .flatten_all()?
                .reshape((2, 200))?
                .narrow(1, 0, 99)?
                .reshape((22, 9))?;
            let ids =
                Tensor::from_vec((0..22u32).map(|i| (i * 7) % 11).collect(), 22, &Device::Cpu)?;
            let e = fused::embedding(table.as_tensor(), &ids)?;
            let z = fused::linear(&(y * e)?, table.as_tensor(), None, true)?.sqr()?.sum_all()?;
            let loss = (loss + z)?;
            let grads = loss.backward()?;
            [
                loss,
                grads.get(&x).unwrap().clone(),
                grads.get(&w).unwrap().clone(),
                grads.get(&b).unwrap().clone(),
            ]
            .into_iter()
            .chain([&img, &k, &table].map(|v| grads.get(v).unwrap().clone()))
            .collect::<Vec<_>>()
            .iter()
            .map(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect()))
            .collect()
        })
    };
    assert_eq!(run(1)?, run(2)?);
    Ok(())
}

/// BatchNorm in training mode over 4D and 5D input, alone and fused with its ReLU.
#[test]
fn batch_norm_in_training_mode_with_and_without_relu() -> Result<()> {
    super::route();
    let cases = [
        ([3usize, 4, 3, 5].as_slice(), false),
        (&[2, 3, 3, 2, 3], false),
        (&[2, 3, 3, 2, 3], true),
        (&[4, 2, 5, 5], true),
    ];
    for (shape, relu) in cases {
        let mut params = ParamStore::new(&Device::Cpu, DType::F64, 0);
        let bn = BatchNorm::new(&mut params, "bn", shape[1])?;
        let named = randomised(&params)?;
        let x = normal("x", shape, -1.0, 3.0)?;
        let mut vars = refs(&named);
        vars.push(("x", &x));
        // Training; a recompute, so the statistics stay put.
        let ctx =
            StageCtx::new(remat::RunPoint { recompute: true, train: true, ..Default::default() });
        let f = || {
            if relu {
                bn.forward_relu(x.as_tensor(), &ctx)
            } else {
                bn.forward(x.as_tensor(), &ctx)
            }
        };
        // No pre-activation within H of zero, where the ReLU's kink would break the difference.
        let pre = bn.forward(x.as_tensor(), &ctx)?.flatten_all()?.to_vec1::<f64>()?;
        assert!(pre.iter().all(|v| v.abs() > 1e-4), "{shape:?}: an input sits on the ReLU's kink");
        check_gradients(&format!("fused BatchNorm {shape:?} relu {relu}"), &vars, f)?;
    }
    Ok(())
}

/// The fused dropout gives the bits of `x * mask` composed, forward and backward, though it holds
/// no mask: its backward draws the mask again from the key.
#[test]
fn fused_dropout_equals_the_composed_mask_bit_for_bit() -> Result<()> {
    super::route();
    let key = RngKey::named(4, "dropout");
    // Several parallel pieces.
    let x =
        Var::from_tensor(&normal("x", &[3, 40000], 0.0, 1.0)?.as_tensor().to_dtype(DType::F32)?)?;
    let mask = Tensor::from_vec(key.dropout_mask(x.elem_count(), 0.3), x.shape(), &Device::Cpu)?;
    let bits = |t: &Tensor| -> Result<Vec<u32>> {
        Ok(t.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
    };
    let (fused_y, composed_y) =
        (fused::dropout(x.as_tensor(), key, 0.3)?, (x.as_tensor() * &mask)?);
    assert_eq!(bits(&fused_y)?, bits(&composed_y)?, "forward");
    let r = Tensor::from_vec(
        RngKey::named(5, "r").normal(x.elem_count(), 0.0, 1.0),
        x.shape(),
        &Device::Cpu,
    )?;
    let (gf, gc) =
        ((fused_y * &r)?.sum_all()?.backward()?, (composed_y * &r)?.sum_all()?.backward()?);
    assert_eq!(bits(gf.get(&x).unwrap())?, bits(gc.get(&x).unwrap())?, "backward");
    Ok(())
}

#[test]
fn fused_linear_both_weight_layouts() -> Result<()> {
    super::route();
    let x = normal("x", &[2, 3, 5], 0.0, 1.0)?;
    let (w_in_out, w_out_in, b) = (
        normal("w", &[5, 4], 0.0, 1.0)?,
        normal("wt", &[4, 5], 0.0, 1.0)?,
        normal("b", &[4], 0.0, 1.0)?,
    );
    check_gradients("fused linear (in, out)", &[("x", &x), ("w", &w_in_out), ("b", &b)], || {
        fused::linear(x.as_tensor(), w_in_out.as_tensor(), Some(b.as_tensor()), false)
    })?;
    check_gradients("fused linear (out, in)", &[("x", &x), ("w", &w_out_in), ("b", &b)], || {
        fused::linear(x.as_tensor(), w_out_in.as_tensor(), Some(b.as_tensor()), true)
    })?;
    check_gradients("fused linear, no bias", &[("x", &x), ("w", &w_out_in)], || {
        fused::linear(x.as_tensor(), w_out_in.as_tensor(), None, true)
    })?;
    // Against the composed product and bias, forward.
    let composed = x
        .as_tensor()
        .reshape((6, 5))?
        .matmul(&w_out_in.as_tensor().t()?)?
        .broadcast_add(b.as_tensor())?
        .reshape((2, 3, 4))?;
    let fused = fused::linear(x.as_tensor(), w_out_in.as_tensor(), Some(b.as_tensor()), true)?;
    let diff = (fused - composed)?.abs()?.max_all()?.to_scalar::<f64>()?;
    assert!(diff < 1e-12, "fused linear differs from matmul + bias by {diff}");
    Ok(())
}

#[test]
fn fused_attention_queries_keys_and_values() -> Result<()> {
    super::route();
    let (q, k, v) = (
        normal("q", &[2, 2, 5, 3], 0.0, 1.0)?,
        normal("k", &[2, 2, 5, 3], 0.0, 1.0)?,
        normal("v", &[2, 2, 5, 3], 0.0, 1.0)?,
    );
    let vars = [("q", &q), ("k", &k), ("v", &v)];
    check_gradients("attention", &vars, || {
        fused::attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), 0.6, false, None, None)
    })?;
    check_gradients("causal attention", &vars, || {
        fused::attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), 0.6, true, None, None)
    })?;
    let key = RngKey::named(6, "attention");
    check_gradients("causal attention, dropout", &vars, || {
        fused::attention(
            q.as_tensor(),
            k.as_tensor(),
            v.as_tensor(),
            0.6,
            true,
            None,
            Some((key, 0.3)),
        )
    })?;
    // Key padding: the first sequence keeps 3 of its 5 keys, the second all of them.
    let padding = Tensor::new(&[[1u32, 1, 0, 1, 0], [1, 1, 1, 1, 1]], &Device::Cpu)?;
    check_gradients("attention, key padding", &vars, || {
        fused::attention(
            q.as_tensor(),
            k.as_tensor(),
            v.as_tensor(),
            0.6,
            false,
            Some(&padding),
            None,
        )
    })?;
    check_gradients("causal attention, key padding, dropout", &vars, || {
        fused::attention(
            q.as_tensor(),
            k.as_tensor(),
            v.as_tensor(),
            0.6,
            true,
            Some(&padding),
            Some((key, 0.3)),
        )
    })
}

/// A padded key changes nothing: not the output, and it gets no gradient.
#[test]
fn padded_keys_are_ignored() -> Result<()> {
    super::route();
    let (q, k, v) = (
        normal("q", &[2, 2, 5, 3], 0.0, 1.0)?,
        normal("k", &[2, 2, 5, 3], 0.0, 1.0)?,
        normal("v", &[2, 2, 5, 3], 0.0, 1.0)?,
    );
    let padding = Tensor::new(&[[1u32, 1, 0, 1, 0], [1, 1, 1, 1, 0]], &Device::Cpu)?;
    let y = fused::attention(
        q.as_tensor(),
        k.as_tensor(),
        v.as_tensor(),
        0.6,
        false,
        Some(&padding),
        None,
    )?;
    // Other values at the padded positions (key 2 and 4 of the first sequence, 4 of the second).
    let noise = (normal("noise", &[2, 2, 5, 3], 0.0, 5.0)?.as_tensor()
        * padding
            .to_dtype(DType::F64)?
            .neg()?
            .affine(1.0, 1.0)?
            .reshape((2, 1, 5, 1))?
            .broadcast_as((2, 2, 5, 3))?)?;
    let y2 = fused::attention(
        q.as_tensor(),
        &(k.as_tensor() + &noise)?,
        &(v.as_tensor() + &noise)?,
        0.6,
        false,
        Some(&padding),
        None,
    )?;
    assert_eq!(y.flatten_all()?.to_vec1::<f64>()?, y2.flatten_all()?.to_vec1::<f64>()?);
    let grads = y.sum_all()?.backward()?;
    for var in [&k, &v] {
        let g = grads.get(var).unwrap().flatten_all()?.to_vec1::<f64>()?; // (2, 2, 5, 3)
        let g4 = |b: usize, h: usize, s: usize| {
            g[((b * 2 + h) * 5 + s) * 3..((b * 2 + h) * 5 + s + 1) * 3].to_vec()
        };
        for h in 0..2 {
            assert!(
                g4(0, h, 2).iter().chain(&g4(0, h, 4)).chain(&g4(1, h, 4)).all(|&x| x == 0.0),
                "a padded key got a gradient"
            );
        }
    }
    // The composed fallback masks the same keys.
    let composed = {
        let keep = padding.ne(0.0)?.reshape((2, 1, 1, 5))?.broadcast_as((2, 2, 5, 5))?;
        let s = q.as_tensor().matmul(&k.as_tensor().t()?)?;
        let s = keep.where_cond(
            &s,
            &Tensor::new(f64::NEG_INFINITY, &Device::Cpu)?.broadcast_as((2, 2, 5, 5))?,
        )?;
        candle_nn::ops::softmax(&(s * 0.6)?, candle_core::D::Minus1)?.matmul(v.as_tensor())?
    };
    let diff = (y - composed)?.abs()?.max_all()?.to_scalar::<f64>()?;
    assert!(diff < 1e-12, "fused and composed padded attention differ by {diff}");
    Ok(())
}

/// The fused attention against softmax, dropout and two matrix products composed, forward and
/// backward, with dropout on (the same key draws the same mask on both sides).
#[test]
fn fused_attention_agrees_with_the_composed_ops() -> Result<()> {
    super::route();
    let to32 = |v: &Var| Var::from_tensor(&v.as_tensor().to_dtype(DType::F32)?);
    let (q, k, v) = (
        to32(&normal("q", &[2, 3, 16, 8], 0.0, 1.0)?)?,
        to32(&normal("k", &[2, 3, 16, 8], 0.0, 1.0)?)?,
        to32(&normal("v", &[2, 3, 16, 8], 0.0, 1.0)?)?,
    );
    let key = RngKey::named(7, "attention");
    let fused_y = fused::attention(
        q.as_tensor(),
        k.as_tensor(),
        v.as_tensor(),
        0.35,
        true,
        None,
        Some((key, 0.2)),
    )?;
    let p = fused::softmax_last_dim(&q.as_tensor().matmul(&k.as_tensor().t()?)?, 0.35, true)?;
    let composed_y = fused::dropout(&p, key, 0.2)?.matmul(v.as_tensor())?;
    let r = Tensor::from_vec(
        RngKey::named(8, "r").normal(fused_y.elem_count(), 0.0, 1.0),
        fused_y.shape(),
        &Device::Cpu,
    )?;
    let (gf, gc) =
        ((&fused_y * &r)?.sum_all()?.backward()?, (&composed_y * &r)?.sum_all()?.backward()?);
    let err = |a: &Tensor, b: &Tensor| -> Result<f32> {
        let scale = b.abs()?.max_all()?.to_scalar::<f32>()?;
        Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()? / scale)
    };
    assert!(
        err(&fused_y, &composed_y)? < 1e-5,
        "forward differs by {:.2e}",
        err(&fused_y, &composed_y)?
    );
    for (name, var) in [("q", &q), ("k", &k), ("v", &v)] {
        let e = err(gf.get(var).unwrap(), gc.get(var).unwrap())?;
        assert!(e < 1e-5, "gradient of {name} differs by {e:.2e}");
    }
    Ok(())
}

#[test]
fn fused_gelu_tanh_and_erf() -> Result<()> {
    super::route();
    let x = normal("x", &[3, 7], 0.0, 2.0)?;
    check_gradients("fused gelu (tanh)", &[("x", &x)], || fused::gelu(x.as_tensor(), false))?;
    check_gradients("fused gelu (erf)", &[("x", &x)], || fused::gelu(x.as_tensor(), true))?;
    // Against candle's own, forward.
    for (exact, candle) in [(false, x.as_tensor().gelu()?), (true, x.as_tensor().gelu_erf()?)] {
        let diff =
            (fused::gelu(x.as_tensor(), exact)? - candle)?.abs()?.max_all()?.to_scalar::<f64>()?;
        assert!(diff < 1e-12, "gelu (exact: {exact}) differs from candle's by {diff}");
    }
    Ok(())
}
