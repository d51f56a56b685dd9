//! Checkpointing an ordinary candle model: a deep MLP built from `candle_nn` layers, each block a
//! `candle_nn::Sequential` (linear + ReLU) turned into a stage by `remat::module` in one line.
//! It trains one step under `off` and under `sqrt`, prints the measured peaks, and checks that
//! `sqrt`'s gradients equal plain candle's (one `backward()` of the whole model) bit for bit.
//!
//!     cargo run --release -p remat --example checkpoint_mlp

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{Module, VarBuilder, VarMap};
use remat::memory::{heap_current, heap_peak, reset_heap_peak, CountingAlloc};
use remat::{Executor, Policy, Stage, StageGraph, StageKind};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const DEPTH: usize = 32;
const WIDTH: usize = 256;
const BATCH: usize = 256;

/// The model as a stage graph: the blocks, then a cross-entropy head on graph input 1.
fn graph(vb: &VarBuilder) -> Result<StageGraph> {
    let mut blocks: Vec<Box<dyn Stage>> = Vec::new();
    for i in 0..DEPTH {
        let block = candle_nn::seq()
            .add(candle_nn::linear(WIDTH, WIDTH, vb.pp(format!("block{i}")))?)
            .add(candle_nn::Activation::Relu);
        blocks.push(Box::new(remat::module(&format!("block{i}"), StageKind::Block, block)));
        // the one line
    }
    let head = candle_nn::linear(WIDTH, 10, vb.pp("head"))?;
    let loss = remat::from_fn("head", StageKind::Other, move |x, _| {
        candle_nn::loss::cross_entropy(&head.forward(&x[0])?, &x[1])
    });
    Ok(StageGraph::chain(blocks, loss)?)
}

/// The bits of every gradient, in the variable map's order.
fn bits(varmap: &VarMap, grads: &candle_core::backprop::GradStore) -> Result<Vec<Vec<u32>>> {
    varmap
        .all_vars()
        .iter()
        .map(|v| {
            Ok(grads
                .get(v)
                .expect("every parameter has a gradient")
                .flatten_all()?
                .to_vec1::<f32>()?
                .into_iter()
                .map(f32::to_bits)
                .collect())
        })
        .collect()
}

pub fn main() -> Result<()> {
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let graph = graph(&VarBuilder::from_varmap(&varmap, DType::F32, &device))?;
    let x = Tensor::randn(0f32, 1.0, (BATCH, WIDTH), &device)?;
    let y = Tensor::arange(0u32, BATCH as u32, &device)?
        .to_dtype(DType::F32)?
        .affine(1.0 / BATCH as f64 * 10.0, 0.0)?
        .floor()?
        .to_dtype(DType::U32)?; // classes 0..10
    let inputs = [x, y];

    let plain = bits(&varmap, &graph.plain_loss(&inputs, 0, 0)?.backward()?)?;
    let mut peaks = Vec::new();
    for policy in [Policy::Off, Policy::Sqrt] {
        let exec = Executor::new(&graph, &policy, varmap.all_vars(), 0)?;
        let before = heap_current();
        reset_heap_peak();
        let out = exec.step(&inputs, 0)?;
        let peak = heap_peak() - before;
        let same = bits(&varmap, &out.grads)? == plain;
        println!(
            "{policy}: {} segments, step peak {:.1} MiB, gradients = plain candle bit for bit: \
             {same}",
            exec.segments().len(),
            remat::memory::mib(peak)
        );
        assert!(same, "{policy}: gradients differ from plain candle");
        peaks.push(peak);
    }
    println!("sqrt / off: {:.2}x the memory", peaks[1] as f64 / peaks[0] as f64);
    assert!(peaks[1] < peaks[0], "sqrt must lower the peak");
    Ok(())
}
