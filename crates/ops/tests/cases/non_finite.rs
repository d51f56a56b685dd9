//! A NaN or an infinity in any input of a fused op comes out of it, forward and (where PyTorch's
//! gradient depends on the values) backward, as it does in PyTorch. Without this, BatchNorm's fused
//! ReLU would turn NaN into 0 (`f32::max` ignores NaN), so one NaN voxel would train the 3D U-Net
//! with a finite loss near ln 3 while NaN reached its weights; and an all-NaN softmax row would
//! come out as zeros.

use candle_core::{DType, Device, Result, Tensor, Var};
use ops::fused::{Activation, GeluForm, Mask};
use ops::{
    conv3d, conv_transpose3d_k2s2, fused, max_pool2d_k3s2p1, max_pool3d_k2s2, Conv3dGeometry,
    WeightLayout,
};
use remat::rng::RngKey;

fn normal(name: &str, shape: &[usize]) -> Result<Var> {
    let v = RngKey::named(7, name).normal(shape.iter().product(), 0.0, 1.0);
    Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu)?)
}

/// `var` with element `at` (flat) set to `value`.
fn poison(var: &Var, at: usize, value: f32) -> Result<()> {
    let mut v = var.as_tensor().flatten_all()?.to_vec1::<f32>()?;
    v[at] = value;
    var.set(&Tensor::from_vec(v, var.shape(), var.device())?)
}

fn finite(t: &Tensor) -> Result<bool> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().all(|v| v.is_finite()))
}

fn has_nan(t: &Tensor) -> Result<bool> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().any(|v| v.is_nan()))
}

/// An input of an op under test: its name, its value, the element to poison, and whether PyTorch's
/// gradients carry the poison backward (no gradient reads a bias, a residual, dropout's or
/// max-pooling's input or an embedding table: theirs stay finite).
struct Input(&'static str, Var, usize, bool);

/// An op over its inputs.
type Op = Box<dyn Fn(&[Var]) -> Result<Tensor>>;

/// An op under test: its inputs and `op` over them.
struct Case {
    name: &'static str,
    inputs: Vec<Input>,
    op: Op,
}

fn check(case: &Case, value: f32) -> Result<()> {
    let vars: Vec<Var> = case.inputs.iter().map(|input| input.1.clone()).collect();
    for (i, Input(input, var, at, grads_poisoned)) in case.inputs.iter().enumerate() {
        let clean = var.as_tensor().copy()?;
        poison(var, *at, value)?;
        let what = format!("{} with {value} in {input}", case.name);
        let y = (case.op)(&vars)?;
        if value.is_nan() {
            assert!(has_nan(&y)?, "{what}: the output has no NaN");
        } else {
            assert!(!finite(&y)?, "{what}: the output is finite");
        }
        if *grads_poisoned {
            let grads = y.sum_all()?.backward()?;
            let poisoned = vars
                .iter()
                .map(|v| grads.get(v).map_or(Ok(false), |g| finite(g).map(|f| !f)))
                .collect::<Result<Vec<bool>>>()?;
            assert!(poisoned.iter().any(|&p| p), "{what}: every gradient is finite");
        }
        vars[i].set(&clean)?;
    }
    Ok(())
}

fn cases(dev: &Device) -> Result<Vec<Case>> {
    let targets = Tensor::new(&[1u32, 0, 3, 2], dev)?;
    let ids = Tensor::new(&[2u32, 0, 2], dev)?;
    let key = RngKey::named(3, "dropout");
    Ok(vec![
        Case {
            name: "layer_norm",
            inputs: vec![
                Input("x", normal("ln-x", &[3, 5])?, 4, true),
                Input("weight", normal("ln-w", &[5])?, 1, true),
                Input("bias", normal("ln-b", &[5])?, 2, false),
            ],
            op: Box::new(|v| fused::layer_norm(&v[0], &v[1], &v[2], 1e-5)),
        },
        Case {
            name: "softmax",
            inputs: vec![Input("x", normal("sm-x", &[2, 3, 4])?, 5, true)],
            op: Box::new(|v| fused::softmax_last_dim(&v[0], 0.5, Mask::Causal)),
        },
        Case {
            name: "cross_entropy",
            inputs: vec![
                Input("logits", normal("ce-l", &[4, 5])?, 7, true),
                Input(
                    "weights",
                    Var::from_tensor(&Tensor::new(&[1f32, 0.5, 2.0, 1.0], dev)?)?,
                    2,
                    true,
                ),
            ],
            op: Box::new(move |v| fused::cross_entropy(&v[0], &targets, Some(&v[1]))),
        },
        Case {
            name: "batch_norm + residual + relu",
            inputs: vec![
                Input("x", normal("bn-x", &[2, 3, 4])?, 9, true),
                Input("weight", normal("bn-w", &[3])?, 1, true),
                Input("bias", normal("bn-b", &[3])?, 0, false),
                Input("residual", normal("bn-r", &[2, 3, 4])?, 3, false),
            ],
            op: Box::new(|v| {
                Ok(fused::batch_norm_train(
                    &v[0],
                    &v[1],
                    &v[2],
                    Some(&v[3]),
                    1e-5,
                    Activation::Relu,
                )?
                .0)
            }),
        },
        Case {
            name: "dropout",
            inputs: vec![Input("x", normal("do-x", &[64])?, 0, false)],
            op: Box::new(move |v| fused::dropout(&v[0], key, 0.5)),
        },
        Case {
            name: "conv3d",
            inputs: vec![
                Input("x", normal("c3-x", &[1, 2, 4, 4, 4])?, 21, true),
                Input("w", normal("c3-w", &[2, 2, 3, 3, 3])?, 5, true),
            ],
            op: Box::new(|v| conv3d(&v[0], &v[1], Conv3dGeometry::same(3))),
        },
        Case {
            name: "conv_transpose3d",
            inputs: vec![
                Input("x", normal("ct-x", &[1, 2, 2, 2, 2])?, 3, true),
                Input("w", normal("ct-w", &[2, 3, 2, 2, 2])?, 4, true),
                Input("b", normal("ct-b", &[3])?, 1, false),
            ],
            op: Box::new(|v| conv_transpose3d_k2s2(&v[0], &v[1], &v[2])),
        },
        Case {
            name: "max_pool2d",
            inputs: vec![Input("x", normal("mp-x", &[1, 2, 5, 5])?, 12, false)],
            op: Box::new(|v| max_pool2d_k3s2p1(&v[0])),
        },
        Case {
            name: "max_pool3d",
            inputs: vec![Input("x", normal("mp3-x", &[1, 2, 4, 4, 4])?, 77, false)],
            op: Box::new(|v| max_pool3d_k2s2(&v[0])),
        },
        Case {
            name: "embedding",
            // Row 2, which the ids look up.
            inputs: vec![Input("table", normal("em-w", &[4, 3])?, 7, false)],
            op: Box::new(move |v| fused::embedding(&v[0], &ids)),
        },
        Case {
            name: "linear",
            inputs: vec![
                Input("x", normal("li-x", &[3, 4])?, 5, true),
                Input("w", normal("li-w", &[2, 4])?, 3, true),
                Input("b", normal("li-b", &[2])?, 1, false),
            ],
            op: Box::new(|v| fused::linear(&v[0], &v[1], Some(&v[2]), WeightLayout::OutIn)),
        },
        Case {
            name: "attention",
            inputs: vec![
                Input("q", normal("at-q", &[1, 2, 3, 4])?, 6, true),
                Input("k", normal("at-k", &[1, 2, 3, 4])?, 2, true),
                Input("v", normal("at-v", &[1, 2, 3, 4])?, 9, true),
            ],
            op: Box::new(move |v| {
                fused::attention(&v[0], &v[1], &v[2], 0.5, Mask::Causal, None, Some((key, 0.1)))
            }),
        },
        Case {
            name: "rotary attention, grouped",
            inputs: vec![
                // At position 0 (cos 1, sin 0): a score of -inf at every key would read as a
                // query with no key left, which attention answers with zeros.
                Input("q", normal("ra-q", &[1, 3, 4, 4])?, 1, true),
                Input("k", normal("ra-k", &[1, 3, 2, 4])?, 2, true),
                Input("v", normal("ra-v", &[1, 3, 2, 4])?, 9, true),
            ],
            op: Box::new(move |v| {
                let rotary = fused::Rotary::new(vec![1.0, 0.1]);
                let dropout = Some((key, 0.1));
                fused::rotary_attention(&v[0], &v[1], &v[2], &rotary, 0.5, Mask::Causal, dropout)
            }),
        },
        Case {
            name: "rms_norm",
            inputs: vec![
                Input("x", normal("rn-x", &[3, 5])?, 4, true),
                Input("weight", normal("rn-w", &[5])?, 1, true),
            ],
            op: Box::new(|v| fused::rms_norm(&v[0], &v[1], 1e-6)),
        },
        Case {
            name: "silu_mul",
            inputs: vec![
                Input("gate", normal("sm-g", &[2, 5])?, 3, true),
                Input("up", normal("sm-u", &[2, 5])?, 6, true),
            ],
            op: Box::new(|v| fused::silu_mul(&v[0], &v[1])),
        },
        Case {
            name: "gelu (tanh)",
            inputs: vec![Input("x", normal("ge-x", &[7])?, 3, true)],
            op: Box::new(|v| fused::gelu(&v[0], GeluForm::Tanh)),
        },
        Case {
            name: "gelu (erf)",
            inputs: vec![Input("x", normal("ge-x", &[7])?, 3, true)],
            op: Box::new(|v| fused::gelu(&v[0], GeluForm::Erf)),
        },
    ])
}

#[test]
fn a_nan_in_any_input_of_a_fused_op_comes_out() -> Result<()> {
    super::route();
    for case in cases(&Device::Cpu)? {
        check(&case, f32::NAN)?;
    }
    Ok(())
}

#[test]
fn an_infinity_in_any_input_of_a_fused_op_comes_out() -> Result<()> {
    super::route();
    for case in cases(&Device::Cpu)? {
        check(&case, f32::INFINITY)?;
    }
    Ok(())
}

/// A whole row of NaN through softmax is NaN, not the zeros of a fully masked row.
#[test]
fn an_all_nan_softmax_row_is_nan() -> Result<()> {
    super::route();
    let x = Tensor::new(&[[f32::NAN, f32::NAN], [0.0, 1.0]], &Device::Cpu)?;
    let y = fused::softmax_last_dim(&x, 1.0, Mask::None)?.to_vec2::<f32>()?;
    assert!(y[0].iter().all(|v| v.is_nan()) && y[1].iter().all(|v| v.is_finite()), "{y:?}");
    Ok(())
}
