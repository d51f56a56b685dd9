//! Two traps a candle-nn user meets, on the published candle, that remat must not leave silent:
//! a `BatchNorm` in training mode updates its running statistics in forward (a recompute would
//! update them twice), and a `LayerNorm` on a contiguous input records no backward (every
//! parameter before it would get no gradient, and training would go on with a frozen model).

use candle_core::{DType, Device, Module, ModuleT, Result, Tensor, Var, D};
use candle_nn::{BatchNorm, Conv2d, Conv2dConfig, LayerNorm, Linear, VarBuilder, VarMap};
use remat::{Executor, Policy, StageGraph, StageKind};
use std::collections::BTreeMap;

/// A residual CNN as candle-nn users write it: `blocks` stages of conv, `BatchNorm` in training
/// mode (`forward_t(x, true)`: the running statistics updated with `Var::set`) and ReLU, a linear
/// head over the pooled features with cross-entropy. Input: (B, 8, 8, 8) images, 4 classes.
fn batch_norm_net(varmap: &VarMap, blocks: usize) -> Result<StageGraph> {
    let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
    let c = 8;
    let mut stages: Vec<Box<dyn remat::Stage>> = Vec::new();
    for i in 0..blocks {
        let vb = vb.pp(format!("block{i}"));
        let conv_cfg = Conv2dConfig { padding: 1, ..Default::default() };
        let conv: Conv2d = candle_nn::conv2d(c, c, 3, conv_cfg, vb.pp("conv"))?;
        let bn: BatchNorm = candle_nn::batch_norm(c, 1e-5, vb.pp("bn"))?;
        stages.push(Box::new(remat::from_fn(
            &format!("block{i}"),
            StageKind::Block,
            move |x, _| {
                let h = bn.forward_t(&conv.forward(&x[0])?, true)?.relu()?;
                &x[0] + h // (B, C, H, W)
            },
        )));
    }
    let head: Linear = candle_nn::linear(c, 4, vb.pp("head"))?;
    let loss = remat::from_fn("head", StageKind::Other, move |x, _| {
        let pooled = x[0].mean(D::Minus1)?.mean(D::Minus1)?; // (B, C)
        candle_nn::loss::cross_entropy(&head.forward(&pooled)?, &x[1])
    });
    Ok(StageGraph::chain(stages, loss)?)
}

/// Every variable's value, by name.
fn values(varmap: &VarMap) -> Result<BTreeMap<String, Vec<u32>>> {
    let data = varmap.data().lock().unwrap();
    let bits = |v: &Var| -> Result<Vec<u32>> {
        Ok(v.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
    };
    data.iter().map(|(name, v)| Ok((name.clone(), bits(v)?))).collect()
}

/// Every variable set back to `initial`.
fn reset(varmap: &VarMap, initial: &BTreeMap<String, Vec<u32>>) -> Result<()> {
    let data = varmap.data().lock().unwrap();
    for (name, v) in data.iter() {
        let floats: Vec<f32> = initial[name].iter().map(|&b| f32::from_bits(b)).collect();
        v.set(&Tensor::from_vec(floats, v.shape(), &Device::Cpu)?)?;
    }
    Ok(())
}

/// Under every policy that recomputes, one step leaves the running statistics `off` leaves, bit
/// for bit (each recomputed stage updates them a second time; remat puts them back), with the
/// executor given every variable as candle-nn's `varmap.all_vars()` gives them, the running
/// statistics among them: they get no gradient and are not reported for it.
#[test]
fn batch_norm_statistics_after_a_step_equal_off() -> Result<()> {
    let varmap = VarMap::new();
    let graph = batch_norm_net(&varmap, 8)?;
    let initial = values(&varmap)?;
    let x = Tensor::randn(0f32, 1., (4, 8, 8, 8), &Device::Cpu)?;
    let y = Tensor::new(&[0u32, 1, 2, 3], &Device::Cpu)?;
    let after_step = |policy: &str| -> Result<BTreeMap<String, Vec<u32>>> {
        reset(&varmap, &initial)?;
        let policy: Policy = policy.parse().map_err(candle_core::Error::wrap)?;
        Executor::new(&graph, &policy, varmap.all_vars(), 7)?.step(&[x.clone(), y.clone()], 0)?;
        let stats = values(&varmap)?.into_iter().filter(|(name, _)| name.contains("running_"));
        Ok(stats.collect())
    };
    let off = after_step("off")?;
    assert_eq!(off.len(), 16, "8 blocks, a mean and a variance each");
    assert!(off.iter().all(|(name, v)| *v != initial[name]), "off updates every statistic");
    for policy in ["sqrt", "every-n=2", "every-two-blocks"] {
        let after = after_step(policy)?;
        let differ: Vec<&String> = off.keys().filter(|name| after[*name] != off[*name]).collect();
        assert!(differ.is_empty(), "{policy}: {differ:?} differ from off's after one step");
    }
    Ok(())
}

/// Four candle-nn `Linear` + `LayerNorm` blocks: candle 0.11's `LayerNorm::forward` on a
/// contiguous input records no backward, so no parameter gets a gradient. The first step fails,
/// naming them from the `VarMap`, under `off` as under `sqrt`; with those parameters declared
/// frozen (`Executor::frozen`) it passes.
#[test]
fn parameters_without_a_gradient_are_named() -> Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let width = 16;
    let blocks: Vec<Box<dyn remat::Stage>> = (0..4)
        .map(|i| -> Result<Box<dyn remat::Stage>> {
            let vb = vb.pp(format!("block{i}"));
            let linear: Linear = candle_nn::linear(width, width, vb.pp("linear"))?;
            let ln: LayerNorm = candle_nn::layer_norm(width, 1e-5, vb.pp("ln"))?;
            let name = format!("block{i}");
            Ok(Box::new(remat::from_fn(&name, StageKind::Block, move |x, _| {
                ln.forward(&linear.forward(&x[0])?.relu()?) // (B, width)
            })))
        })
        .collect::<Result<_>>()?;
    let loss = remat::from_fn("loss", StageKind::Other, |x, _| x[0].sqr()?.mean_all());
    let graph = StageGraph::chain_with_inputs(1, blocks, loss)?;
    let x = Tensor::randn(0f32, 1., (8, width), &Device::Cpu)?;
    let names = varmap.data().lock().unwrap().clone();
    for policy in [Policy::Off, Policy::Sqrt] {
        let exec = Executor::new(&graph, &policy, varmap.all_vars(), 0)?.named(&names);
        let err =
            exec.step(std::slice::from_ref(&x), 0).err().expect("no parameter gets a gradient");
        let msg = err.to_string();
        assert!(
            msg.contains("16 of the 16 parameters")
                && msg.contains("`block0.linear.weight`")
                && msg.contains("layer_norm_slow"),
            "{policy}: {msg}"
        );
        let frozen =
            Executor::new(&graph, &policy, varmap.all_vars(), 0)?.frozen(&varmap.all_vars());
        frozen.step(std::slice::from_ref(&x), 0)?;
    }
    Ok(())
}

/// A parameter no stage reads, in a network whose others all get gradients: named unless it is
/// declared frozen.
#[test]
fn a_frozen_parameter_passes_when_declared() -> Result<()> {
    let varmap = VarMap::new();
    let graph = batch_norm_net(&varmap, 2)?;
    let unused = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu).get(3, "unused")?;
    let unused = Var::from_tensor(&unused)?;
    let names = varmap.data().lock().unwrap().clone();
    let x = Tensor::randn(0f32, 1., (4, 8, 8, 8), &Device::Cpu)?;
    let y = Tensor::new(&[0u32, 1, 2, 3], &Device::Cpu)?;
    let exec = || Executor::new(&graph, &Policy::Sqrt, varmap.all_vars(), 0);
    let msg = exec()?.named(&names).step(&[x.clone(), y.clone()], 0).err().unwrap().to_string();
    assert!(msg.contains("1 of the ") && msg.contains("`unused`"), "{msg}");
    exec()?.frozen(&[unused]).step(&[x, y], 0)?;
    Ok(())
}
