//! Trains the small GPT for a few steps under a policy and prints each step's loss and measured
//! heap peak: `cargo run --release -- sqrt` (or `off`, `every-n=2`, `every-two-blocks`, ...).

use candle_core::Device;
use candle_nn::{Optimizer, SGD};
use remat::memory::{heap_current, heap_peak, reset_heap_peak, CountingAlloc};
use remat::{Executor, Policy};
use small_transformer::{batch, new, Config};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let policy: Policy = std::env::args().nth(1).unwrap_or_else(|| "sqrt".into()).parse()?;
    let cfg = Config { vocab: 96, context: 128, width: 128, heads: 4, layers: 12, dropout: 0.1 };
    let device = Device::Cpu;
    let (varmap, graph) = new(&cfg, &device)?;
    let exec = Executor::new(&graph, &policy, varmap.all_vars(), 0)?;
    let mut sgd = SGD::new(varmap.all_vars(), 0.05)?;
    println!("{policy}: segments {:?}", exec.segments());
    for step in 0..10 {
        let inputs = batch(&cfg, 16, 128, step, &device)?;
        let before = heap_current();
        reset_heap_peak();
        let out = exec.step(&inputs, step)?;
        let peak = heap_peak() - before;
        sgd.step(&out.grads)?;
        println!(
            "step {step}: loss {:.4}, step peak {:.1} MiB",
            out.loss.to_scalar::<f32>()?,
            remat::memory::mib(peak)
        );
    }
    Ok(())
}
