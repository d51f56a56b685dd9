//! The optimizers against PyTorch's update rules, and what they share: an update in parts equals
//! one update, half-precision parameters keep f32 state, the state's size.

use super::*;
use candle_core::{DType, Device, Var};
use candle_nn::Optimizer;

const C: [f64; 3] = [0.5, -1.5, 3.0];

/// Three steps of `opt` on loss = sum(w^2 / 2 + c w) (so g = w + c) against `by_hand(step, w,
/// g)` updating f64 copies with the rule as PyTorch writes it.
fn follows<O: Optimizer>(
    dtype: DType,
    tol: f64,
    build: impl Fn(Vec<Var>) -> Result<O>,
    mut by_hand: impl FnMut(i32, &mut [f64], &[f64]),
) -> Result<()> {
    let w = Var::from_tensor(&Tensor::new(&[1.0f32, -2.0, 0.25], &Device::Cpu)?.to_dtype(dtype)?)?;
    let c = Tensor::new(&C, &Device::Cpu)?.to_dtype(dtype)?;
    let mut opt = build(vec![w.clone()])?;
    let mut expect = [1.0f64, -2.0, 0.25];
    for step in 1..=3 {
        let loss = ((w.as_tensor().sqr()? * 0.5)? + w.as_tensor().mul(&c)?)?.sum_all()?;
        opt.step(&loss.backward()?)?;
        let g: Vec<f64> = expect.iter().zip(C).map(|(w, c)| w + c).collect();
        by_hand(step, &mut expect, &g);
        let got = w.as_tensor().to_dtype(DType::F64)?.to_vec1::<f64>()?;
        for (got, want) in got.iter().zip(expect) {
            assert!(
                (got - want).abs() <= tol * (1.0 + want.abs()),
                "{dtype:?} step {step}: {got} vs {want}"
            );
        }
    }
    Ok(())
}

fn adamw_by_hand(p: ParamsAdamW) -> impl FnMut(i32, &mut [f64], &[f64]) {
    let (mut m, mut v) = ([0.0; 3], [0.0; 3]);
    move |t, w, g| {
        for i in 0..3 {
            w[i] *= 1.0 - p.lr * p.weight_decay;
            m[i] = p.beta1 * m[i] + (1.0 - p.beta1) * g[i];
            v[i] = p.beta2 * v[i] + (1.0 - p.beta2) * g[i] * g[i];
            let denom = v[i].sqrt() / (1.0 - p.beta2.powi(t)).sqrt() + p.eps;
            w[i] -= p.lr / (1.0 - p.beta1.powi(t)) * m[i] / denom;
        }
    }
}

fn sgd_by_hand(p: ParamsSgd) -> impl FnMut(i32, &mut [f64], &[f64]) {
    let mut v = [0.0; 3];
    move |t, w, g| {
        for i in 0..3 {
            let d = g[i] + p.weight_decay * w[i];
            v[i] = if t == 1 { d } else { p.momentum * v[i] + d };
            w[i] -= p.lr * v[i];
        }
    }
}

/// Tolerances: the dtype's rounding of the parameter (half precision keeps f32 moments).
const DTYPES: [(DType, f64); 4] =
    [(DType::F32, 1e-6), (DType::F64, 1e-12), (DType::BF16, 8e-3), (DType::F16, 1e-3)];

#[test]
fn adamw_follows_the_pytorch_update_rule() -> Result<()> {
    let p = ParamsAdamW { lr: 0.1, weight_decay: 0.1, ..Default::default() };
    for (dtype, tol) in DTYPES {
        follows(dtype, tol, |vars| AdamW::new(vars, p.clone()), adamw_by_hand(p.clone()))?;
        follows(
            dtype,
            tol,
            |vars| Ok(AdamW::new(vars, p.clone())?.composed()),
            adamw_by_hand(p.clone()),
        )?;
    }
    Ok(())
}

#[test]
fn sgd_follows_the_pytorch_update_rule() -> Result<()> {
    let p = ParamsSgd { lr: 0.1, momentum: 0.9, weight_decay: 0.01 };
    for (dtype, tol) in DTYPES {
        follows(dtype, tol, |vars| SgdMomentum::new(vars, p), sgd_by_hand(p))?;
        follows(dtype, tol, |vars| Ok(SgdMomentum::new(vars, p)?.composed()), sgd_by_hand(p))?;
    }
    Ok(())
}

/// Updating in parts (the optimizer inside backward) gives the bits of one update, for every
/// optimizer: three parameters over three steps, updated as {2} then {0, 1}, against all at
/// once.
#[test]
fn an_update_in_parts_equals_one_update() -> Result<()> {
    type Build = fn(Vec<Var>) -> Result<Box<dyn TrainOptimizer>>;
    let optimizers: [(&str, Build); 3] = [
        ("adamw", |vars| {
            Ok(Box::new(AdamW::new(vars, ParamsAdamW { lr: 0.1, ..Default::default() })?))
        }),
        ("sgd", |vars| {
            Ok(Box::new(SgdMomentum::new(vars, ParamsSgd { lr: 0.1, ..Default::default() })?))
        }),
        ("adafactor", |vars| {
            Ok(Box::new(Adafactor::new(vars, ParamsAdafactor { lr: 0.1, ..Default::default() })?))
        }),
    ];
    for (kind, build) in optimizers {
        let run = |parts: bool| -> Result<Vec<Vec<u32>>> {
            let vars = (0..3)
                .map(|i| {
                    Var::from_tensor(
                        &Tensor::arange(i as f32, i as f32 + 6.0, &Device::Cpu)?.reshape((2, 3))?,
                    )
                })
                .collect::<Result<Vec<Var>>>()?;
            let mut opt = build(vars.clone())?;
            for _ in 0..3 {
                let loss = vars.iter().try_fold(Tensor::new(0f32, &Device::Cpu)?, |acc, v| {
                    acc + v.as_tensor().powf(3.0)?.sum_all()?
                })?;
                let grads = loss.backward()?;
                if !parts {
                    opt.update(&grads)?;
                    continue;
                }
                opt.begin_update()?;
                for part in [&vars[2..], &vars[..2]] {
                    let mut some = GradStore::default();
                    for v in part {
                        some.insert(
                            v.as_tensor(),
                            grads.get(v).expect("every parameter has a gradient").clone(),
                        );
                    }
                    opt.update_some(&some)?;
                }
            }
            vars.iter()
                .map(|v| {
                    Ok(v.as_tensor()
                        .flatten_all()?
                        .to_vec1::<f32>()?
                        .iter()
                        .map(|x| x.to_bits())
                        .collect())
                })
                .collect()
        };
        let (whole, parts) = (run(false)?, run(true)?);
        assert!(
            whole != vec![vec![0u32; 6]; 3] && parts == whole,
            "{kind}: the update in parts differs from one update"
        );
    }
    Ok(())
}

/// A half-precision parameter keeps f32 moments, updated in place from its gradient.
#[test]
fn half_precision_parameters_keep_f32_state() -> Result<()> {
    let w = Var::from_tensor(&Tensor::ones(4, DType::BF16, &Device::Cpu)?)?;
    let mut opt = AdamW::new(vec![w.clone()], ParamsAdamW::default())?;
    opt.step(&w.as_tensor().sum_all()?.backward()?)?;
    let state = opt.state()?;
    assert_eq!(
        (state["m.0"].dtype(), state["v.0"].dtype(), w.dtype()),
        (DType::F32, DType::F32, DType::BF16)
    );
    assert_eq!(state["m.0"].to_vec1::<f32>()?, vec![0.1f32; 4]);
    assert_eq!(opt.state_bytes(), 2 * 4 * 4);
    Ok(())
}

/// SGD's buffers exist from the first gradient on; its state size counts them from the start.
#[test]
fn state_bytes_count_the_state_a_step_will_hold() -> Result<()> {
    let w = Var::from_tensor(&Tensor::ones(10, DType::F32, &Device::Cpu)?)?;
    let sgd = SgdMomentum::new(vec![w.clone()], ParamsSgd::default())?;
    assert!(sgd.state()?.is_empty());
    assert_eq!(sgd.state_bytes(), 40);
    assert_eq!(AdamW::new(vec![w], ParamsAdamW::default())?.state_bytes(), 80);
    Ok(())
}
