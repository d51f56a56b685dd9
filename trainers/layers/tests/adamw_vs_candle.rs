//! Our AdamW against candle-nn's: the same update, with a lower step peak. In a binary of its own:
//! the counting allocator is process-wide, and tests of one binary run concurrently.

use candle_core::backprop::GradStore;
use candle_core::{Device, Result, Tensor, Var};
use candle_nn::Optimizer;
use layers::{AdamW, ParamsAdamW};
use remat::memory::peak_during;

#[global_allocator]
static ALLOC: remat::memory::CountingAlloc = remat::memory::CountingAlloc;

/// Heap above the level before `f`, at its peak.
fn peak_of(f: impl FnOnce() -> Result<()>) -> Result<u64> {
    let (result, peak) = peak_during(f);
    result.map(|()| peak)
}

/// Our AdamW against candle-nn's over 5 steps of varying gradients: the same parameters within
/// float tolerance (the same rule, computed in another order), and a lower step peak (candle-nn's
/// builds several parameter-sized temporaries per update).
#[test]
fn adamw_matches_candle_nn_with_a_lower_peak() -> Result<()> {
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
        assert!(ours_peak < theirs_peak, "step {step}: ours peaked at {ours_peak} B, candle-nn's at {theirs_peak} B");
        let diff = (ours_w.as_tensor() - theirs_w.as_tensor())?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "step {step}: parameters differ by {diff}");
    }
    Ok(())
}
