//! Misuse is an error, never silence. The recompute check: a stage whose recompute would differ
//! from its forward fails the step, naming it, instead of returning wrong gradients (dropout
//! drawn from candle's generator, `candle_nn::ops::dropout`, is caught; dropout from the stage's
//! context passes, its gradients equal to plain candle's bit for bit). A `+keep=` that keeps
//! nothing is refused, and so is planning without the heap meter (this binary installs none).

use candle_core::{DType, Device, Result, Tensor, Var};
use remat::{Executor, Policy, Stage, StageGraph, StageKind};

/// Four blocks relu(x @ w_i) followed by dropout, drawn by `draw`, and a mean-square loss.
fn graph(ws: &[Var], draw: fn(&Tensor, &remat::StageCtx) -> Result<Tensor>) -> StageGraph {
    let blocks: Vec<Box<dyn Stage>> = ws
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let w = w.as_tensor().clone();
            Box::new(remat::from_fn(&format!("block{i}"), StageKind::Block, move |x, ctx| {
                draw(&x[0].matmul(&w)?.relu()?, ctx)
            })) as Box<dyn Stage>
        })
        .collect();
    let loss = remat::from_fn("loss", StageKind::Other, |x, _| (&x[0] - &x[1])?.sqr()?.mean_all());
    StageGraph::chain(blocks, loss).unwrap()
}

fn setup() -> Result<(Vec<Var>, [Tensor; 2])> {
    let dev = Device::Cpu;
    let ws = (0..4)
        .map(|_| Var::from_tensor(&(Tensor::randn(0f32, 0.3, (32, 32), &dev)?)))
        .collect::<Result<Vec<_>>>()?;
    let x = Tensor::randn(0f32, 1.0, (64, 32), &dev)?;
    Ok((ws, [x, Tensor::zeros((64, 32), DType::F32, &dev)?]))
}

#[test]
fn dropout_from_candles_generator_is_caught_and_named() -> Result<()> {
    let (ws, inputs) = setup()?;
    let graph = graph(&ws, |x, _| candle_nn::ops::dropout(x, 0.2));
    let exec = Executor::new(&graph, &Policy::EveryN(2), ws.clone(), 0).unwrap();
    let err =
        exec.step(&inputs, 0).err().expect("the recompute differs from the forward").to_string();
    assert!(
        err.contains("stage 0 (`block0`)")
            && err.contains("candle_nn::ops::dropout")
            && err.contains("ctx.dropout"),
        "{err}"
    );
    // Unchecked, the step returns gradients, and they are not plain candle's.
    let unchecked =
        Executor::new(&graph, &Policy::EveryN(2), ws.clone(), 0).unwrap().without_recompute_check();
    assert!(unchecked.step(&inputs, 0).is_ok());
    // `off` recomputes nothing: nothing to check, nothing wrong.
    assert!(Executor::new(&graph, &Policy::Off, ws, 0).unwrap().step(&inputs, 0).is_ok());
    Ok(())
}

#[test]
fn dropout_from_the_context_passes_bit_for_bit() -> Result<()> {
    let (ws, inputs) = setup()?;
    let graph = graph(&ws, |x, ctx| ctx.dropout(x, 0.2));
    let bits = |grads: &candle_core::backprop::GradStore| -> Vec<Vec<u32>> {
        ws.iter()
            .map(|w| {
                grads
                    .get(w)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .into_iter()
                    .map(f32::to_bits)
                    .collect()
            })
            .collect()
    };
    let plain = bits(&graph.plain_loss(&inputs, 0, 3)?.backward()?);
    for policy in [Policy::EveryN(2), Policy::Sqrt, Policy::EveryN(1)] {
        let out = Executor::new(&graph, &policy, ws.clone(), 0).unwrap().step(&inputs, 3).unwrap();
        assert!(bits(&out.grads) == plain, "{policy}: gradients differ from plain candle's");
    }
    Ok(())
}

#[test]
fn a_keep_that_keeps_nothing_is_refused_naming_what_the_graph_runs() -> Result<()> {
    let (ws, inputs) = setup()?;
    let graph = graph(&ws, |x, _| Ok(x.clone())); // candle's own matmul: not a keepable op
    let policy: Policy = "every-n=2+keep=matmul".parse().unwrap();
    let err = Executor::new(&graph, &policy, ws.clone(), 0)
        .unwrap()
        .step(&inputs, 0)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("+keep=matmul keeps nothing")
            && err.contains("they run: none")
            && err.contains("remat::keep::op"),
        "{err}"
    );
    Ok(())
}

#[test]
fn planning_without_the_heap_meter_is_refused() -> Result<()> {
    let (ws, inputs) = setup()?;
    let graph = graph(&ws, |x, _| Ok(x.clone()));
    assert!(!remat::memory::heap_meter_installed());
    let err = remat::plan::Profile::measure(&graph, &inputs, &ws, 64, 0)
        .expect_err("refused")
        .to_string();
    assert!(err.contains("needs the heap meter") && err.contains("#[global_allocator]"), "{err}");
    Ok(())
}
