//! One dropout, two routes: a stage's own (`StageCtx::dropout`, composed of candle ops, candle
//! keeping the mask) and the fused one (`ops::dropout`, drawing the mask again in backward) draw
//! their keys by one rule and apply one mask, so a model may use either.

use candle_core::{DType, Device, Result, Tensor};
use remat::rng::RngKey;
use remat::StageCtx;

/// Every element's bits, widened exactly to f64.
fn bits(t: &Tensor) -> Result<Vec<u64>> {
    Ok(t.to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?
        .iter()
        .map(|x| x.to_bits())
        .collect())
}

#[test]
fn both_routes_give_one_mask_for_one_key() -> Result<()> {
    // Several of the fused kernel's parallel pieces, the last one odd (it ends mid-word).
    let n = 3 * (1 << 14) + 5;
    let x = Tensor::new(RngKey::named(1, "x").normal(n, 0.0, 1.0), &Device::Cpu)?;
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        let x = x.to_dtype(dtype)?;
        for p in [0.1f32, 0.5, 0.9] {
            // The mask itself: the fused dropout of ones is the mask `RngKey::dropout_mask` gives.
            let key = RngKey::named(2, "mask");
            let mask = Tensor::new(key.dropout_mask(n, p), &Device::Cpu)?.to_dtype(dtype)?;
            let fused = ops::fused::dropout(&x.ones_like()?, key, p)?;
            assert_eq!(bits(&fused)?, bits(&mask)?, "{dtype:?} p={p}: the fused mask differs");
            // Through a stage's context: two call sites, each route drawing the same two keys.
            let (composed, fused) = (StageCtx::train(11, 3, 2), StageCtx::train(11, 3, 2));
            for site in 0..2 {
                assert_eq!(
                    bits(&composed.dropout(&x, p)?)?,
                    bits(&ops::dropout(&x, p, &fused)?)?,
                    "{dtype:?} p={p}, call site {site}: the two routes differ"
                );
            }
        }
    }
    Ok(())
}

/// Backward too: the gradient of `sum(y * r)` through either route is the same.
#[test]
fn both_routes_give_one_gradient() -> Result<()> {
    let n = 2 * (1 << 14) + 3;
    let r = Tensor::new(RngKey::named(3, "r").normal(n, 0.0, 1.0), &Device::Cpu)?;
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        let x = candle_core::Var::from_tensor(
            &Tensor::new(RngKey::named(1, "x").normal(n, 0.0, 1.0), &Device::Cpu)?
                .to_dtype(dtype)?,
        )?;
        let grad = |y: Tensor| -> Result<Vec<u64>> {
            let loss = (y.to_dtype(DType::F32)? * &r)?.sum_all()?;
            bits(loss.backward()?.get(&x).expect("x has a gradient"))
        };
        let (composed, fused) = (StageCtx::train(5, 1, 0), StageCtx::train(5, 1, 0));
        assert_eq!(
            grad(composed.dropout(&x, 0.3)?)?,
            grad(ops::dropout(&x, 0.3, &fused)?)?,
            "{dtype:?}: the two routes' gradients differ"
        );
    }
    Ok(())
}

#[test]
fn both_routes_draw_a_key_only_for_a_mask_they_apply() -> Result<()> {
    let x = Tensor::ones(8, DType::F32, &Device::Cpu)?;
    // Evaluation, or p = 0 in training: the identity, and no key drawn.
    for (ctx, p) in
        [(StageCtx::eval(), 0.5), (StageCtx::eval(), 0.0), (StageCtx::train(0, 0, 0), 0.0)]
    {
        assert_eq!(bits(&ctx.dropout(&x, p)?)?, bits(&x)?);
        assert_eq!(bits(&ops::dropout(&x, p, &ctx)?)?, bits(&x)?);
        assert_eq!(ctx.next_key().call, 0, "p={p}: a dropout that masks nothing drew a key");
    }
    let ctx = StageCtx::train(0, 0, 0);
    ctx.dropout(&x, 0.5)?;
    ops::dropout(&x, 0.5, &ctx)?;
    assert_eq!(ctx.next_key().call, 2, "each applied mask draws one key");
    for p in [-0.1, 1.0] {
        let (a, b) = (ctx.dropout(&x, p).unwrap_err(), ops::dropout(&x, p, &ctx).unwrap_err());
        let first_line = |e: candle_core::Error| e.to_string().lines().next().map(str::to_owned);
        assert_eq!(first_line(a), first_line(b));
    }
    Ok(())
}
