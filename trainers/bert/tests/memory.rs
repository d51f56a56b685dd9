//! `sqrt` lowers the measured step peak of a deep BERT clearly. The only test in its binary: the
//! counting allocator is process-wide, and tests of one binary run concurrently.

use bert::{Bert, Config, MlmData};
use candle_core::Device;
use remat::memory::CountingAlloc;
use remat::Executor;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Heap peak of the second step (see `trainkit::second_step_peak`).
fn step_peak(policy: &str) -> u64 {
    let cfg = Config::tiny(24, 64);
    let (batch, seq) = (8, 128);
    let model = Bert::new(cfg.clone(), &Device::Cpu, 3).unwrap();
    let exec = Executor::new(model.graph(), &policy.parse().unwrap(), model.params().vars(), 3).unwrap();
    let data = MlmData::synthetic(cfg.vocab_size, seq, 1).unwrap();
    trainkit::second_step_peak(&exec, |step| {
        model.inputs(&data.batch(step, batch), batch, seq, &Device::Cpu).unwrap()
    })
    .unwrap()
}

#[test]
fn sqrt_halves_the_step_peak_of_a_deep_model() {
    let (off, sqrt) = (step_peak("off"), step_peak("sqrt"));
    eprintln!("step peak: off {off} B, sqrt {sqrt} B ({:.2}x)", sqrt as f64 / off as f64);
    assert!(sqrt * 2 <= off, "sqrt peak {sqrt} B is more than half of off {off} B");
}
