//! Half precision through the fused ops: activations in bf16 or f16 next to f32 weights. Each op
//! computes in f32 from the widened operands, so on the same values it must give exactly the f32
//! path's results rounded to the half type: outputs and input gradients bit for bit, weight
//! gradients in f32 and equal to the f32 path's. The loss of half-precision logits is f32. The
//! softmax keeps its output for backward, rounded to the half type, so its input gradient is only
//! close to the f32 path's.

use candle_core::{DType, Device, Result, Tensor, Var};
use ops::fused::{Activation, GeluForm, Mask};
use ops::{
    conv2d, conv3d, conv_transpose3d_k2s2, fused, max_pool2d_k3s2p1, Conv3dGeometry, WeightLayout,
};
use remat::rng::RngKey;

/// Random values that `dtype` represents exactly, as f32.
fn values(name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let v = RngKey::named(21, name).normal(shape.iter().product(), 0.0, 1.0);
    Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dtype)?.to_dtype(DType::F32)
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    t.to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()
        .map(|v| v.into_iter().map(f32::to_bits).collect())
}

/// `f(activations, weights)` with the activations `acts` (name, shape) in `dtype` and in f32, the
/// weights `weights` in f32 both times: the outputs, the activation gradients and the weight
/// gradients of `sum(y * r)` must agree as described above.
fn same_as_f32(
    dtype: DType,
    acts: &[(&str, &[usize])],
    weights: &[(&str, &[usize])],
    f: impl Fn(&[Tensor], &[Tensor]) -> Result<Tensor>,
) -> Result<()> {
    check(dtype, acts, weights, f, true)
}

/// [`same_as_f32`], with `exact_grads: false` for an op that keeps its rounded output: the
/// activation gradients then within 1 % of the largest.
fn check(
    dtype: DType,
    acts: &[(&str, &[usize])],
    weights: &[(&str, &[usize])],
    f: impl Fn(&[Tensor], &[Tensor]) -> Result<Tensor>,
    exact_grads: bool,
) -> Result<()> {
    let make = |specs: &[(&str, &[usize])], in_dtype: DType| -> Result<Vec<Var>> {
        specs
            .iter()
            .map(|(n, s)| Var::from_tensor(&values(n, s, dtype)?.to_dtype(in_dtype)?))
            .collect()
    };
    let (half_acts, wide_acts) = (make(acts, dtype)?, make(acts, DType::F32)?);
    let (half_w, wide_w) = (make(weights, DType::F32)?, make(weights, DType::F32)?);
    let tensors = |vars: &[Var]| vars.iter().map(|v| v.as_tensor().clone()).collect::<Vec<_>>();
    let y_half = f(&tensors(&half_acts), &tensors(&half_w))?;
    let y_wide = f(&tensors(&wide_acts), &tensors(&wide_w))?;
    let out_dtype = y_half.dtype();
    assert!(
        out_dtype == dtype || (out_dtype == DType::F32 && y_half.rank() == 0),
        "output in {out_dtype:?}"
    );
    assert_eq!(bits(&y_half)?, bits(&y_wide.to_dtype(out_dtype)?)?, "outputs differ");
    let r = values("r", y_half.dims(), dtype)?;
    let grads_half = (&y_half * r.to_dtype(out_dtype)?)?.sum_all()?.backward()?;
    let grads_wide = (&y_wide * r)?.sum_all()?.backward()?;
    for (i, (h, w)) in half_acts.iter().zip(&wide_acts).enumerate() {
        let (gh, gw) =
            (grads_half.get(h).expect("a gradient"), grads_wide.get(w).expect("a gradient"));
        assert_eq!(gh.dtype(), dtype, "activation {i}: gradient in {:?}", gh.dtype());
        if exact_grads {
            assert_eq!(bits(gh)?, bits(&gw.to_dtype(dtype)?)?, "activation {i}: gradients differ");
        } else {
            let largest = gw.abs()?.max_all()?.to_scalar::<f32>()?;
            let err = (gh.to_dtype(DType::F32)? - gw)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(
                err <= 0.01 * largest,
                "activation {i}: gradients differ by {err} (largest {largest})"
            );
        }
    }
    for (i, (h, w)) in half_w.iter().zip(&wide_w).enumerate() {
        let (gh, gw) =
            (grads_half.get(h).expect("a gradient"), grads_wide.get(w).expect("a gradient"));
        assert_eq!(gh.dtype(), DType::F32, "weight {i}: gradient in {:?}", gh.dtype());
        assert_eq!(bits(gh)?, bits(gw)?, "weight {i}: gradients differ");
    }
    Ok(())
}

fn each_half(test: impl Fn(DType) -> Result<()>) -> Result<()> {
    test(DType::BF16)?;
    test(DType::F16)
}

#[test]
fn transformer_ops() -> Result<()> {
    super::route();
    each_half(|dt| {
        same_as_f32(dt, &[("x", &[2, 3, 16])], &[("w", &[16]), ("b", &[16])], |a, w| {
            fused::layer_norm(&a[0], &w[0], &w[1], 1e-5)
        })?;
        same_as_f32(dt, &[("x", &[2, 3, 16])], &[("w", &[8, 16]), ("b", &[8])], |a, w| {
            fused::linear(&a[0], &w[0], Some(&w[1]), WeightLayout::OutIn)
        })?;
        same_as_f32(dt, &[("x", &[2, 3, 16])], &[("w", &[16, 8])], |a, w| {
            fused::linear(&a[0], &w[0], None, WeightLayout::InOut)
        })?;
        same_as_f32(dt, &[("x", &[2, 3, 16])], &[], |a, _| fused::gelu(&a[0], GeluForm::Tanh))?;
        check(
            dt,
            &[("x", &[2, 3, 16])],
            &[],
            |a, _| fused::softmax_last_dim(&a[0], 0.5, Mask::Causal),
            false,
        )?;
        same_as_f32(dt, &[("x", &[2, 3, 16])], &[], |a, _| {
            fused::dropout(&a[0], RngKey::named(1, "d"), 0.25)
        })?;
        let key = Some((RngKey::named(2, "a"), 0.1));
        same_as_f32(
            dt,
            &[("q", &[2, 2, 5, 4]), ("k", &[2, 2, 5, 4]), ("v", &[2, 2, 5, 4])],
            &[],
            |a, _| fused::attention(&a[0], &a[1], &a[2], 0.5, Mask::Causal, None, key),
        )?;
        let rotary = fused::Rotary::new(vec![1.0, 0.01]);
        same_as_f32(
            dt,
            &[("q", &[2, 5, 4, 4]), ("k", &[2, 5, 2, 4]), ("v", &[2, 5, 2, 4])],
            &[],
            |a, _| fused::rotary_attention(&a[0], &a[1], &a[2], &rotary, 0.5, Mask::Causal, key),
        )?;
        same_as_f32(dt, &[("x", &[2, 3, 16])], &[("w", &[16])], |a, w| {
            fused::rms_norm(&a[0], &w[0], 1e-6)
        })?;
        same_as_f32(dt, &[("gate", &[2, 3, 16]), ("up", &[2, 3, 16])], &[], |a, _| {
            fused::silu_mul(&a[0], &a[1])
        })?;
        let targets = Tensor::new(&[3u32, 0, 7, 5, 1, 2], &Device::Cpu)?;
        same_as_f32(dt, &[("logits", &[6, 8])], &[], |a, _| {
            fused::cross_entropy(&a[0], &targets, None)
        })?;
        Ok(())
    })
}

#[test]
fn convolution_ops() -> Result<()> {
    super::route();
    each_half(|dt| {
        same_as_f32(dt, &[("x", &[2, 3, 9, 9])], &[("w", &[4, 3, 3, 3])], |a, w| {
            conv2d(&a[0], &w[0], 1, 2)
        })?;
        let g = Conv3dGeometry { stride_d: 1, stride_hw: 1, pad_d: 1, pad_hw: 1 };
        same_as_f32(dt, &[("x", &[1, 2, 4, 5, 6])], &[("w", &[3, 2, 3, 3, 3])], |a, w| {
            conv3d(&a[0], &w[0], g)
        })?;
        same_as_f32(
            dt,
            &[("x", &[1, 2, 3, 3, 3])],
            &[("w", &[2, 3, 2, 2, 2]), ("b", &[3])],
            |a, w| conv_transpose3d_k2s2(&a[0], &w[0], &w[1]),
        )?;
        same_as_f32(dt, &[("x", &[2, 3, 9, 9])], &[], |a, _| max_pool2d_k3s2p1(&a[0]))?;
        same_as_f32(
            dt,
            &[("x", &[2, 3, 4, 4]), ("r", &[2, 3, 4, 4])],
            &[("w", &[3]), ("b", &[3])],
            |a, w| {
                Ok(fused::batch_norm_train(
                    &a[0],
                    &w[0],
                    &w[1],
                    Some(&a[1]),
                    1e-5,
                    Activation::Relu,
                )?
                .0)
            },
        )?;
        Ok(())
    })
}
