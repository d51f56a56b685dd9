//! The optimizers update in place: a step allocates nothing the size of a parameter; and our
//! AdamW gives candle-nn's update with a lower peak. The counting allocator is process-wide, so
//! the tests of this binary take turns.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::Optimizer;
use optim::{Adafactor, AdamW, ParamsAdafactor, ParamsAdamW, ParamsSgd, SgdMomentum};
use remat::memory::peak_during;

#[global_allocator]
static ALLOC: remat::memory::CountingAlloc = remat::memory::CountingAlloc;

/// Held by each test while it measures.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Heap above the level before `f`, at its peak.
fn peak_of(f: impl FnOnce() -> Result<()>) -> Result<u64> {
    let (result, peak) = peak_during(f);
    result.map(|()| peak)
}

#[test]
fn updates_allocate_nothing_parameter_sized() -> Result<()> {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let n = 1 << 20; // 4 MiB in f32
    let param_bytes = 4 * n as u64;
    // A matrix, so that Adafactor factors its second moment.
    let w =
        Var::from_tensor(&Tensor::arange(0f32, n as f32, &Device::Cpu)?.reshape((1024, 1024))?)?;
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
        assert!(
            adafactor_peak < param_bytes / 16,
            "Adafactor step allocated {adafactor_peak} bytes at its peak"
        );
    }
    Ok(())
}

/// Our AdamW against candle-nn's over 5 steps of varying gradients: the same parameters within
/// float tolerance (the same rule, computed in another order), and a lower step peak (candle-nn's
/// builds several parameter-sized temporaries per update).
#[test]
fn adamw_matches_candle_nn_with_a_lower_peak() -> Result<()> {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let n = 1 << 18;
    let start = Tensor::arange(0f32, n as f32, &Device::Cpu)?.affine(1e-5, -1.0)?;
    let (ours_w, theirs_w) = (Var::from_tensor(&start)?, Var::from_tensor(&start)?);
    let params = ParamsAdamW { lr: 1e-2, ..Default::default() };
    let mut ours = AdamW::new(vec![ours_w.clone()], params.clone())?;
    let mut theirs = candle_nn::AdamW::new(vec![theirs_w.clone()], params)?;
    for step in 0..5 {
        let g = start.affine(0.3, step as f64 * 0.1)?.sin()?;
        let grads = |w: &Var| -> Result<GradStore> {
            let mut s = GradStore::default();
            s.insert(w.as_tensor(), g.clone());
            Ok(s)
        };
        let (gs_ours, gs_theirs) = (grads(&ours_w)?, grads(&theirs_w)?);
        let ours_peak = peak_of(|| ours.step(&gs_ours))?;
        let theirs_peak = peak_of(|| theirs.step(&gs_theirs))?;
        assert!(
            ours_peak < theirs_peak,
            "step {step}: ours peaked at {ours_peak} B, candle-nn's at {theirs_peak} B"
        );
        let diff =
            (ours_w.as_tensor() - theirs_w.as_tensor())?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "step {step}: parameters differ by {diff}");
    }
    Ok(())
}

/// On the device-generic route (`Path::Generic`, as a GPU takes it), where the updates are
/// composed from candle's ops, an AdamW, SGD or Adafactor step holds at most three temporaries of a
/// parameter's size at once.
#[test]
fn composed_updates_hold_few_parameter_sized_temporaries() -> Result<()> {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let n = 1 << 20;
    let param_bytes = 4 * n as u64;
    // A matrix, so that Adafactor factors its second moment.
    let w = Var::from_tensor(
        &Tensor::arange(0f32, n as f32, &Device::Cpu)?.affine(1e-6, 0.0)?.reshape((1024, 1024))?,
    )?;
    let mut grads = GradStore::default();
    grads.insert(
        w.as_tensor(),
        Tensor::ones((1024, 1024), DType::F32, &Device::Cpu)?.affine(0.5, 0.0)?,
    );
    let mut adam = AdamW::new(vec![w.clone()], ParamsAdamW::default())?;
    let mut sgd = SgdMomentum::new(vec![w.clone()], ParamsSgd::default())?;
    let mut adafactor = Adafactor::new(vec![w.clone()], ParamsAdafactor::default())?;
    ops::fused::set_path(ops::fused::Path::Generic);
    let peaks = (|| -> Result<[u64; 3]> {
        sgd.step(&grads)?; // its buffer, once
        Ok([
            peak_of(|| adam.step(&grads))?,
            peak_of(|| sgd.step(&grads))?,
            peak_of(|| adafactor.step(&grads))?,
        ])
    })();
    ops::fused::set_path(ops::fused::Path::Kernel);
    for (name, peak) in ["AdamW", "SGD", "Adafactor"].into_iter().zip(peaks?) {
        eprintln!("composed: {name} peaks at {:.2} parameters", peak as f64 / param_bytes as f64);
        assert!(peak <= 3 * param_bytes + 64 * 1024, "{name}'s composed step peaked at {peak} B");
    }
    Ok(())
}
