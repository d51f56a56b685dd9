//! Every layer of this crate against central finite differences in f64: the gradient of every input
//! *and* every weight, on odd shapes, non-trivial affine parameters, and BatchNorm in training
//! mode. Plus the rules finite differences cannot see: BatchNorm's running statistics and dropout's
//! mask replay.
//!
//! Tolerance: with step h = 1e-6 in f64 the central difference is off by O(h^2 f''') ~ 1e-12 from
//! truncation and ~ 1e-16 |f| / h = 1e-10 |f| from rounding, so `|fd - backward| <= 1e-6 (1 +
//! |fd|)` leaves four orders of magnitude of slack and still catches a gradient off by 1e-5
//! relative.
//!
//! The cases by what they test: `layers` (the layers a model calls, and the rules of BatchNorm's
//! statistics and dropout's replay), `fused_ops` (the kernels of `ops::fused`, each against finite
//! differences), `agreement` (every kernel against its composed candle op, and across thread
//! counts). Here, what they share: random operands and the finite-difference check. Each test
//! binary that includes them sets the route first (`crate::route`).

mod agreement;
mod fused_ops;
mod layers;

use candle_core::{DType, Device, Result, Tensor, Var};
use params::ParamStore;
use remat::rng::RngKey;

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
        var.set(&normal(name, var.dims(), mean, 0.5)?.as_tensor().to_dtype(var.dtype())?)?;
    }
    Ok(named)
}

fn refs(named: &[(String, Var)]) -> Vec<(&str, &Var)> {
    named.iter().map(|(n, v)| (n.as_str(), v)).collect()
}

/// The output of `f` and the gradients of a weighted sum of it for each of `vars`, as f64 bits.
fn output_and_gradients(
    vars: &[(&str, &candle_core::Var)],
    f: &dyn Fn() -> Result<Tensor>,
) -> Result<Vec<Vec<f64>>> {
    let y = f()?;
    let grads = weighted_sum(&|| y.to_dtype(DType::F64))?.backward()?;
    let mut out = vec![y.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?];
    for (name, v) in vars {
        let g = grads
            .get(v.as_tensor())
            .ok_or_else(|| candle_core::Error::Msg(format!("no gradient of {name}")))?;
        out.push(g.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?);
    }
    Ok(out)
}
