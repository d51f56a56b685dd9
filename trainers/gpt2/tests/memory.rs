//! `sqrt` at least halves the measured step peak of a deep GPT-2. The only test in its binary:
//! the counting allocator is process-wide, and tests of one binary run concurrently.

use candle_core::Device;
use datasets::tokens::Batcher;
use gpt2::{Config, Gpt2};
use remat::memory::CountingAlloc;
use remat::Executor;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Heap peak of the second step (see `trainkit::second_step_peak`).
fn step_peak(policy: &str) -> u64 {
    let cfg = Config::tiny(24, 64);
    let (batch, seq) = (8, 128);
    let model = Gpt2::new(cfg.clone(), &Device::Cpu, 3).unwrap();
    let exec = Executor::new(model.graph(), &policy.parse().unwrap(), model.params().vars(), 3).unwrap();
    let text = datasets::text::synthetic_corpus(1, 100_000);
    let data = Batcher::new(datasets::text::byte_tokens(&text), seq, cfg.vocab_size, 1).unwrap();
    trainkit::second_step_peak(&exec, |step| {
        let (x, y) = data.batch(step, batch);
        model.inputs(&x, &y, batch, seq, &Device::Cpu).unwrap()
    })
    .unwrap()
}

#[test]
fn sqrt_halves_the_step_peak_of_a_deep_model() {
    assert!(remat::memory::heap_meter_installed());
    let (off, sqrt) = (step_peak("off"), step_peak("sqrt"));
    eprintln!("step peak: off {off} B, sqrt {sqrt} B ({:.2}x)", sqrt as f64 / off as f64);
    assert!(sqrt * 2 <= off, "sqrt peak {sqrt} B is more than half of off {off} B");
}
