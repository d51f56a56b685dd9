//! The fused ops (`ops::fused`) called directly, each against central finite differences in f64
//! and, where it has one, the composed candle op it replaces. Not here: the layers that call them
//! (`layers`), every fused op against its composed equivalent and across thread counts
//! (`agreement`).

use super::{check_gradients, normal, output_and_gradients, randomised, refs};
use candle_core::{DType, Device, Result, Tensor, Var};
use ops::fused::{GeluForm, Mask};
use ops::{fused, BatchNorm, WeightLayout};
use params::ParamStore;
use remat::rng::RngKey;
use remat::StageCtx;

#[test]
fn fused_layer_norm_input_weight_and_bias() -> Result<()> {
    crate::route();
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
fn fused_rms_norm_input_and_weight() -> Result<()> {
    crate::route();
    let (x, w) = (normal("x", &[3, 2, 7], 0.5, 2.0)?, normal("w", &[7], 1.0, 0.5)?);
    check_gradients("fused rms_norm", &[("x", &x), ("w", &w)], || {
        fused::rms_norm(x.as_tensor(), w.as_tensor(), 1e-5)
    })?;
    // Against transformers' LlamaRMSNorm written out: x rsqrt(mean(x^2) + eps) w.
    let x = x.as_tensor();
    let rms = (x.sqr()?.mean_keepdim(2)? + 1e-5)?.sqrt()?;
    let written = x.broadcast_div(&rms)?.broadcast_mul(w.as_tensor())?;
    let diff = (fused::rms_norm(x, w.as_tensor(), 1e-5)? - written)?.abs()?.max_all()?;
    assert!(diff.to_scalar::<f64>()? < 1e-12, "rms_norm differs from its formula by {diff}");
    Ok(())
}

#[test]
fn fused_silu_mul_gate_and_up() -> Result<()> {
    crate::route();
    let (gate, up) = (normal("gate", &[3, 11], 0.0, 3.0)?, normal("up", &[3, 11], 0.0, 1.0)?);
    check_gradients("fused silu_mul", &[("gate", &gate), ("up", &up)], || {
        fused::silu_mul(gate.as_tensor(), up.as_tensor())
    })?;
    let candle = (gate.as_tensor().silu()? * up.as_tensor())?;
    let fused_y = fused::silu_mul(gate.as_tensor(), up.as_tensor())?;
    let diff = (fused_y - candle)?.abs()?.max_all()?.to_scalar::<f64>()?;
    assert!(diff < 1e-12, "silu_mul differs from candle's silu times up by {diff}");
    Ok(())
}

/// Grouped (4 query heads over 2 key/value heads), causal, with dropout: the rotation of q and k
/// inside the op and its turn back in backward; q, k, v (B, T, heads, d), token by token.
#[test]
fn rotary_attention_queries_keys_and_values() -> Result<()> {
    crate::route();
    let (q, k, v) = (
        normal("rq", &[2, 5, 4, 4], 0.0, 1.0)?,
        normal("rk", &[2, 5, 2, 4], 0.0, 1.0)?,
        normal("rv", &[2, 5, 2, 4], 0.0, 1.0)?,
    );
    let rotary = fused::Rotary::new(vec![1.0, 0.3]);
    let key = RngKey::named(6, "rotary attention");
    let vars = [("q", &q), ("k", &k), ("v", &v)];
    for (mask, dropout) in
        [(Mask::Causal, None), (Mask::Causal, Some((key, 0.3))), (Mask::None, None)]
    {
        check_gradients(&format!("rotary attention {mask:?}, dropout {dropout:?}"), &vars, || {
            let (q, k, v) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
            fused::rotary_attention(q, k, v, &rotary, 0.6, mask, dropout)
        })?;
    }
    Ok(())
}

/// transformers' `apply_rotary_pos_emb` written out (q cos + rotate_half(q) sin, cos and sin of
/// `inv_freq * position` in f32), then attention over heads first: the same values and gradients
/// as the op that turns q and k inside, token by token, which keeps no turned or transposed copy.
#[test]
fn rotary_attention_equals_attention_of_turned_queries_and_keys() -> Result<()> {
    crate::route();
    let to32 = |v: &Var| Var::from_tensor(&v.as_tensor().to_dtype(DType::F32)?);
    let (q, k, v) = (
        to32(&normal("tq", &[2, 16, 4, 8], 0.0, 1.0)?)?,
        to32(&normal("tk", &[2, 16, 2, 8], 0.0, 1.0)?)?,
        to32(&normal("tv", &[2, 16, 2, 8], 0.0, 1.0)?)?,
    );
    let inv_freq: Vec<f32> = (0..4).map(|i| 10_000f32.powf(-(2 * i) as f32 / 8.0)).collect();
    let freqs = Tensor::arange(0u32, 16, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .unsqueeze(1)?
        .broadcast_mul(&Tensor::new(inv_freq.as_slice(), &Device::Cpu)?.unsqueeze(0)?)?;
    let emb = Tensor::cat(&[&freqs, &freqs], 1)?; // (T, d)
    let (cos, sin) = (emb.cos()?, emb.sin()?);
    let turn = |x: &Tensor| -> Result<Tensor> {
        let (x1, x2) = (x.narrow(3, 0, 4)?, x.narrow(3, 4, 4)?);
        let half = Tensor::cat(&[&x2.neg()?, &x1], 3)?;
        x.broadcast_mul(&cos)? + half.broadcast_mul(&sin)?
    };
    let key = Some((RngKey::named(9, "rotary"), 0.2));
    let (qt, kt, vt) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
    let inside = fused::rotary_attention(
        qt,
        kt,
        vt,
        &fused::Rotary::new(inv_freq),
        0.35,
        Mask::Causal,
        key,
    )?;
    let heads_first = |x: &Tensor| x.transpose(1, 2);
    let (qh, kh, vh) = (heads_first(qt)?, heads_first(kt)?, heads_first(vt)?);
    let outside = fused::attention(&turn(&qh)?, &turn(&kh)?, &vh, 0.35, Mask::Causal, None, key)?
        .transpose(1, 2)?
        .contiguous()?;
    assert_agree(&inside, &outside, &[("q", &q), ("k", &k), ("v", &v)], 1e-6, 1e-5)
}

/// A frozen linear layer with its LoRA adapter, in both weight layouts, with and without the
/// adapter's input dropout: the input's and the adapter's gradients.
#[test]
fn lora_linear_input_and_adapters() -> Result<()> {
    crate::route();
    let (x, bias) = (normal("lx", &[3, 2, 5], 0.0, 1.0)?, normal("lbias", &[4], 0.0, 0.5)?);
    let (a, b) = (normal("la", &[2, 5], 0.0, 0.5)?, normal("lb", &[4, 2], 0.0, 0.5)?);
    let key = RngKey::named(4, "lora");
    for (layout, w) in [(WeightLayout::OutIn, [4, 5]), (WeightLayout::InOut, [5, 4])] {
        let w = normal("lw", &w, 0.0, 0.5)?;
        for dropout in [None, Some((key, 0.3))] {
            let vars = [("x", &x), ("a", &a), ("b", &b)];
            check_gradients(
                &format!("lora_linear {layout:?}, dropout {dropout:?}"),
                &vars,
                || {
                    let base = (w.as_tensor(), Some(bias.as_tensor()));
                    let adapter = (a.as_tensor(), b.as_tensor(), 2.0);
                    fused::lora_linear(
                        x.as_tensor(),
                        fused::LinearInput::AsIs,
                        base,
                        layout,
                        adapter,
                        dropout,
                    )
                },
            )?;
        }
    }
    Ok(())
}

/// A linear layer of a GELU's output as one op (an MLP's second projection), plain and under a
/// LoRA adapter with input dropout, both GELU forms and both weight layouts: the input's, weight's,
/// bias's and adapter's gradients against finite differences, and the same bits, forward and
/// backward, in f64 and f32, as the GELU and the layer apart.
#[test]
fn linear_of_a_gelu() -> Result<()> {
    crate::route();
    let key = RngKey::named(5, "lora");
    for dtype in [DType::F64, DType::F32] {
        let var = |name: &str, shape: &[usize], std: f32| -> Result<Var> {
            Var::from_tensor(&normal(name, shape, 0.0, std)?.to_dtype(dtype)?)
        };
        let (x, b) = (var("gx", &[3, 2, 5], 1.5)?, var("gb", &[4], 0.5)?);
        let (la, lb) = (var("ga", &[2, 5], 0.5)?, var("glb", &[4, 2], 0.5)?);
        for form in [GeluForm::Tanh, GeluForm::Erf] {
            for (layout, shape) in [(WeightLayout::OutIn, [4, 5]), (WeightLayout::InOut, [5, 4])] {
                let w = var("gw", &shape, 0.5)?;
                let what = format!("{dtype:?} {form:?} {layout:?}");
                let (xt, wt, bt) = (x.as_tensor(), w.as_tensor(), Some(b.as_tensor()));
                let one_op = || fused::gelu_linear(xt, form, wt, bt, layout);
                let two_ops = || fused::linear(&fused::gelu(xt, form)?, wt, bt, layout);
                let vars = [("x", &x), ("w", &w), ("b", &b)];
                if dtype == DType::F64 {
                    check_gradients(&format!("gelu_linear {what}"), &vars, one_op)?;
                }
                let (one, two) =
                    (output_and_gradients(&vars, &one_op)?, output_and_gradients(&vars, &two_ops)?);
                assert_eq!(one, two, "gelu_linear {what}");
                // A frozen weight (x's gradient only, no GELU value made in backward) and a
                // constant x (the weight's gradient only, no GELU gradient): the same bits too.
                let (frozen, constant) = (wt.detach(), xt.detach());
                for (vars, x, w) in [([("x", &x)], xt, &frozen), ([("w", &w)], &constant, wt)] {
                    let one_op = || fused::gelu_linear(x, form, w, bt, layout);
                    let two_ops = || fused::linear(&fused::gelu(x, form)?, w, bt, layout);
                    let (one, two) = (
                        output_and_gradients(&vars, &one_op)?,
                        output_and_gradients(&vars, &two_ops)?,
                    );
                    assert_eq!(one, two, "gelu_linear {what}, {} alone", vars[0].0);
                }
                let adapter = (la.as_tensor(), lb.as_tensor(), 2.0);
                let (base, dropout) = ((wt, bt), Some((key, 0.3)));
                let gelu = fused::LinearInput::Gelu(form);
                let one_op = || fused::lora_linear(xt, gelu, base, layout, adapter, dropout);
                let two_ops = || {
                    let g = fused::gelu(xt, form)?;
                    fused::lora_linear(&g, fused::LinearInput::AsIs, base, layout, adapter, dropout)
                };
                let vars = [("x", &x), ("a", &la), ("b", &lb)];
                if dtype == DType::F64 {
                    check_gradients(&format!("lora_linear of a GELU {what}"), &vars, one_op)?;
                }
                let (one, two) =
                    (output_and_gradients(&vars, &one_op)?, output_and_gradients(&vars, &two_ops)?);
                assert_eq!(one, two, "lora_linear of a GELU {what}");
            }
        }
    }
    Ok(())
}

#[test]
fn fused_softmax_plain_scaled_and_causal() -> Result<()> {
    crate::route();
    let x = normal("x", &[2, 3, 5, 5], 0.0, 2.0)?;
    check_gradients("fused softmax", &[("x", &x)], || {
        fused::softmax_last_dim(x.as_tensor(), 1.0, Mask::None)
    })?;
    check_gradients("fused softmax, scaled, causal", &[("x", &x)], || {
        fused::softmax_last_dim(x.as_tensor(), 0.37, Mask::Causal)
    })?;
    let wide = normal("wide", &[4, 9], 0.0, 2.0)?; // not square: rows of one block
    check_gradients("fused softmax, 4x9", &[("x", &wide)], || {
        fused::softmax_last_dim(wide.as_tensor(), 0.5, Mask::None)
    })
}

#[test]
fn fused_cross_entropy_plain_and_weighted() -> Result<()> {
    crate::route();
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
    // Ignored targets (a causal LM's padding) weigh 0: the same loss and gradient as the weights
    // above, whose zeros fall where these are ignored.
    let ignoring = Tensor::new(&[0u32, fused::IGNORE, 3, 3, fused::IGNORE, 1], &Device::Cpu)?;
    check_gradients("fused cross_entropy, ignored targets", &[("logits", &logits)], || {
        fused::cross_entropy(logits.as_tensor(), &ignoring, None)
    })?;
    let (a, b) = (
        fused::cross_entropy(logits.as_tensor(), &ignoring, None)?.to_scalar::<f64>()?,
        fused::cross_entropy(logits.as_tensor(), &targets, Some(&weights))?.to_scalar::<f64>()?,
    );
    assert_eq!(a.to_bits(), b.to_bits(), "ignored {a}, weighted 0 {b}");
    let none = Tensor::new(&[fused::IGNORE; 6], &Device::Cpu)?;
    let err = fused::cross_entropy(logits.as_tensor(), &none, None).unwrap_err().to_string();
    assert!(err.contains("every target ignored"), "{err}");
    Ok(())
}

/// BatchNorm in training mode over 4D and 5D input, alone and fused with its ReLU.
#[test]
fn batch_norm_in_training_mode_with_and_without_relu() -> Result<()> {
    crate::route();
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
    crate::route();
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
    crate::route();
    let x = normal("x", &[2, 3, 5], 0.0, 1.0)?;
    let (w_in_out, w_out_in, b) = (
        normal("w", &[5, 4], 0.0, 1.0)?,
        normal("wt", &[4, 5], 0.0, 1.0)?,
        normal("b", &[4], 0.0, 1.0)?,
    );
    check_gradients("fused linear (in, out)", &[("x", &x), ("w", &w_in_out), ("b", &b)], || {
        fused::linear(x.as_tensor(), w_in_out.as_tensor(), Some(b.as_tensor()), WeightLayout::InOut)
    })?;
    check_gradients("fused linear (out, in)", &[("x", &x), ("w", &w_out_in), ("b", &b)], || {
        fused::linear(x.as_tensor(), w_out_in.as_tensor(), Some(b.as_tensor()), WeightLayout::OutIn)
    })?;
    check_gradients("fused linear, no bias", &[("x", &x), ("w", &w_out_in)], || {
        fused::linear(x.as_tensor(), w_out_in.as_tensor(), None, WeightLayout::OutIn)
    })?;
    // Against the composed product and bias, forward.
    let composed = x
        .as_tensor()
        .reshape((6, 5))?
        .matmul(&w_out_in.as_tensor().t()?)?
        .broadcast_add(b.as_tensor())?
        .reshape((2, 3, 4))?;
    let fused = fused::linear(
        x.as_tensor(),
        w_out_in.as_tensor(),
        Some(b.as_tensor()),
        WeightLayout::OutIn,
    )?;
    let diff = (fused - composed)?.abs()?.max_all()?.to_scalar::<f64>()?;
    assert!(diff < 1e-12, "fused linear differs from matmul + bias by {diff}");
    Ok(())
}

/// `r + x @ w` as one op, both weight layouts: the gradients of x, w and the residual, and the
/// values of the product added to the residual.
#[test]
fn fused_linear_residual_input_weight_and_residual() -> Result<()> {
    crate::route();
    let (x, r) = (normal("x", &[2, 3, 5], 0.0, 1.0)?, normal("r", &[2, 3, 4], 0.0, 1.0)?);
    for (layout, w) in [(WeightLayout::InOut, [5, 4]), (WeightLayout::OutIn, [4, 5])] {
        let w = normal("w", &w, 0.0, 1.0)?;
        let vars = [("x", &x), ("w", &w), ("r", &r)];
        check_gradients(&format!("fused linear_residual {layout:?}"), &vars, || {
            fused::linear_residual(x.as_tensor(), w.as_tensor(), r.as_tensor(), layout)
        })?;
        let (x, w, r) = (x.as_tensor(), w.as_tensor(), r.as_tensor());
        let apart = (r + fused::linear(x, w, None, layout)?)?;
        let diff = (fused::linear_residual(x, w, r, layout)? - apart)?.abs()?.max_all()?;
        assert!(diff.to_scalar::<f64>()? < 1e-12, "differs from r + linear(x) by {diff}");
    }
    // A residual that is not the product's shape is refused, naming both.
    let w = normal("w", &[4, 5], 0.0, 1.0)?;
    let short = normal("short", &[2, 3, 3], 0.0, 1.0)?;
    let err = fused::linear_residual(
        x.as_tensor(),
        w.as_tensor(),
        short.as_tensor(),
        WeightLayout::OutIn,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("[2, 3, 3]") && err.contains("[2, 3, 4]"), "{err}");
    Ok(())
}

#[test]
fn fused_attention_queries_keys_and_values() -> Result<()> {
    crate::route();
    let (q, k, v) = (
        normal("q", &[2, 2, 5, 3], 0.0, 1.0)?,
        normal("k", &[2, 2, 5, 3], 0.0, 1.0)?,
        normal("v", &[2, 2, 5, 3], 0.0, 1.0)?,
    );
    let vars = [("q", &q), ("k", &k), ("v", &v)];
    check_gradients("attention", &vars, || {
        fused::attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), 0.6, Mask::None, None, None)
    })?;
    check_gradients("causal attention", &vars, || {
        fused::attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), 0.6, Mask::Causal, None, None)
    })?;
    let key = RngKey::named(6, "attention");
    check_gradients("causal attention, dropout", &vars, || {
        fused::attention(
            q.as_tensor(),
            k.as_tensor(),
            v.as_tensor(),
            0.6,
            Mask::Causal,
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
            Mask::None,
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
            Mask::Causal,
            Some(&padding),
            Some((key, 0.3)),
        )
    })
}

/// A padded key changes nothing: not the output, and it gets no gradient.
#[test]
fn padded_keys_are_ignored() -> Result<()> {
    crate::route();
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
        Mask::None,
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
        Mask::None,
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

/// Fails unless `a` and `b`, two ways of computing one thing from `vars`, agree within
/// `forward` of `b`'s largest value, and so do the gradients of a random projection of each
/// (within `backward`).
fn assert_agree(
    a: &Tensor,
    b: &Tensor,
    vars: &[(&str, &Var)],
    forward: f32,
    backward: f32,
) -> Result<()> {
    let r = Tensor::from_vec(
        RngKey::named(8, "r").normal(a.elem_count(), 0.0, 1.0),
        a.shape(),
        &Device::Cpu,
    )?;
    let (ga, gb) = ((a * &r)?.sum_all()?.backward()?, (b * &r)?.sum_all()?.backward()?);
    let err = |x: &Tensor, y: &Tensor| -> Result<f32> {
        let scale = y.abs()?.max_all()?.to_scalar::<f32>()?;
        Ok((x - y)?.abs()?.max_all()?.to_scalar::<f32>()? / scale)
    };
    let e = err(a, b)?;
    assert!(e < forward, "forward differs by {e:.2e}");
    for (name, var) in vars {
        let e = err(ga.get(var).unwrap(), gb.get(var).unwrap())?;
        assert!(e < backward, "gradient of {name} differs by {e:.2e}");
    }
    Ok(())
}

/// Grouped-query attention (4 query heads sharing 2 key/value heads, as Llama's and Qwen's) equals
/// attention over K and V repeated for each query head, forward and backward (the repeat's
/// gradient sums over the heads that share it), with the causal mask, key padding and dropout.
#[test]
fn grouped_query_attention_equals_attention_over_repeated_keys() -> Result<()> {
    crate::route();
    let to32 = |v: &Var| Var::from_tensor(&v.as_tensor().to_dtype(DType::F32)?);
    let (q, k, v) = (
        to32(&normal("gq", &[2, 4, 16, 8], 0.0, 1.0)?)?,
        to32(&normal("gk", &[2, 2, 16, 8], 0.0, 1.0)?)?,
        to32(&normal("gv", &[2, 2, 16, 8], 0.0, 1.0)?)?,
    );
    let padding =
        Tensor::new((0..32).map(|i| f32::from(i < 29)).collect::<Vec<_>>(), &Device::Cpu)?
            .reshape((2, 16))?;
    let key = RngKey::named(9, "grouped attention");
    let attend = |k: &Tensor, v: &Tensor| {
        fused::attention(q.as_tensor(), k, v, 0.35, Mask::Causal, Some(&padding), Some((key, 0.2)))
    };
    // (B, 2, T, d) -> (B, 4, T, d): query heads 0 and 1 share key/value head 0, 2 and 3 head 1.
    let repeat =
        |x: &Tensor| x.unsqueeze(2)?.expand((2, 2, 2, 16, 8))?.contiguous()?.reshape((2, 4, 16, 8));
    let grouped = attend(k.as_tensor(), v.as_tensor())?;
    let repeated = attend(&repeat(k.as_tensor())?, &repeat(v.as_tensor())?)?;
    assert_agree(&grouped, &repeated, &[("q", &q), ("k", &k), ("v", &v)], 1e-6, 1e-5)
}

/// The fused attention against softmax, dropout and two matrix products composed, forward and
/// backward, with dropout on (the same key draws the same mask on both sides).
#[test]
fn fused_attention_agrees_with_the_composed_ops() -> Result<()> {
    crate::route();
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
        Mask::Causal,
        None,
        Some((key, 0.2)),
    )?;
    let p =
        fused::softmax_last_dim(&q.as_tensor().matmul(&k.as_tensor().t()?)?, 0.35, Mask::Causal)?;
    let composed_y = fused::dropout(&p, key, 0.2)?.matmul(v.as_tensor())?;
    assert_agree(&fused_y, &composed_y, &[("q", &q), ("k", &k), ("v", &v)], 1e-5, 1e-5)
}

#[test]
fn fused_gelu_tanh_and_erf() -> Result<()> {
    crate::route();
    let x = normal("x", &[3, 7], 0.0, 2.0)?;
    check_gradients("fused gelu (tanh)", &[("x", &x)], || {
        fused::gelu(x.as_tensor(), GeluForm::Tanh)
    })?;
    check_gradients("fused gelu (erf)", &[("x", &x)], || {
        fused::gelu(x.as_tensor(), GeluForm::Erf)
    })?;
    // Against candle's own, forward.
    let forms =
        [(GeluForm::Tanh, x.as_tensor().gelu()?), (GeluForm::Erf, x.as_tensor().gelu_erf()?)];
    for (form, candle) in forms {
        let diff =
            (fused::gelu(x.as_tensor(), form)? - candle)?.abs()?.max_all()?.to_scalar::<f64>()?;
        assert!(diff < 1e-12, "gelu ({form:?}) differs from candle's by {diff}");
    }
    Ok(())
}
