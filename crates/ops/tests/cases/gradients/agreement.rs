//! Every fused op at once: against its composed candle equivalent in f32, forward and backward,
//! and with the same bits at 1 and 2 threads (recompute under checkpointing depends on it). Not
//! here: each op's finite differences (`fused_ops`).

use super::{normal, weighted_sum};
use candle_core::{DType, Device, Result, Tensor, Var};
use ops::fused::Mask;
use ops::{fused, max_pool2d_k3s2p1, BatchNorm, WeightLayout};
use params::ParamStore;
use remat::StageCtx;

/// Each fused op and its composed candle equivalent, forward and backward, in f32: within a few
/// f32 rounding steps of each other (the tolerance is on the scaled error, as the fixtures').
#[test]
fn fused_ops_agree_with_the_composed_candle_ops() -> Result<()> {
    crate::route();
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
            Box::new(|| fused::softmax_last_dim(x.as_tensor(), 0.25, Mask::None)),
            Box::new(|| candle_nn::ops::softmax(&(x.as_tensor() * 0.25)?, 3)),
        ),
        (
            "causal softmax",
            Box::new(|| fused::softmax_last_dim(x.as_tensor(), 0.25, Mask::Causal)),
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
    crate::route();
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
            // RMSNorm's weight gradient is a sum across rows; the gated product is elementwise.
            let h = fused::silu_mul(&fused::rms_norm(&h, w.as_tensor(), 1e-6)?, &h)?;
            let p = fused::softmax_last_dim(&h.reshape((3, 100, 64))?, 0.5, Mask::None)?
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
            let z = fused::linear(&(y * e)?, table.as_tensor(), None, WeightLayout::OutIn)?
                .sqr()?
                .sum_all()?;
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
