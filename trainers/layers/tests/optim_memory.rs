//! The optimizers update in place: a step allocates nothing the size of a parameter.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::Optimizer;
use layers::{Adafactor, AdamW, ParamsAdafactor, ParamsAdamW, ParamsSgd, SgdMomentum};
use remat::memory::peak_during;

#[global_allocator]
static ALLOC: remat::memory::CountingAlloc = remat::memory::CountingAlloc;

/// Heap above the level before `f`, at its peak.
fn peak_of(f: impl FnOnce() -> Result<()>) -> Result<u64> {
    let (result, peak) = peak_during(f);
    result.map(|()| peak)
}

#[test]
fn updates_allocate_nothing_parameter_sized() -> Result<()> {
    let n = 1 << 20; // 4 MiB in f32
    let param_bytes = 4 * n as u64;
    // A matrix, so that Adafactor factors its second moment.
    let w = Var::from_tensor(&Tensor::arange(0f32, n as f32, &Device::Cpu)?.reshape((1024, 1024))?)?;
    let mut grads = GradStore::default();
    grads.insert(w.as_tensor(), Tensor::ones((1024, 1024), DType::F32, &Device::Cpu)?);
    let mut adam = AdamW::new(vec![w.clone()], ParamsAdamW::default())?;
    let mut sgd = SgdMomentum::new(vec![w.clone()], ParamsSgd::default())?;
    let mut adafactor = Adafactor::new(vec![w.clone()], ParamsAdafactor::default())?;
    sgd.step(&grads)?; // allocates its momentum buffer, once
    for _ in 0..2 {
        let adam_peak = peak_of(|| adam.step(&grads))?;
        let sgd_peak = peak_of(|| sgd.step(&grads))?;
        assert!(adam_peak < param_bytes / 16, "AdamW step allocated {adam_peak} bytes at its peak");
        assert!(sgd_peak < param_bytes / 16, "SGD step allocated {sgd_peak} bytes at its peak");
        let adafactor_peak = peak_of(|| adafactor.step(&grads))?;
        assert!(adafactor_peak < param_bytes / 16, "Adafactor step allocated {adafactor_peak} bytes at its peak");
    }
    Ok(())
}
