//! A gradient handed back through a reshape (every conv2d is a depth-1 conv3d between two of them,
//! every BatchNorm reshapes its weights) is stored as it is, not copied: the vendored candle drops
//! its own handle to the gradient before storing the reshaped view (patch 0004). Unchecked, the
//! view shared its memory with that handle, so candle stored a copy: a ResNet-152 step made a
//! hundred, 31 ms of it on one thread. The counting allocator is process-wide: one test in this
//! binary.

use candle_core::{Device, Result, Tensor, Var};
use remat::memory::peak_during;

#[global_allocator]
static ALLOC: remat::memory::CountingAlloc = remat::memory::CountingAlloc;

#[test]
fn a_reshaped_gradient_is_stored_without_a_copy() -> Result<()> {
    let shape = [4, 256, 8, 8];
    let n: usize = shape.iter().product();
    let x = Var::from_tensor(&Tensor::zeros(&shape, candle_core::DType::F32, &Device::Cpu)?)?;
    let values = remat::rng::RngKey::named(5, "gradient").normal(n, 0.0, 1.0);
    let g = Tensor::from_vec(values.clone(), (4, 256, 1, 8, 8), &Device::Cpu)?;
    // The seed hands `g` over: the reshape's output gets it as its only holder.
    let root = remat::exec::seed(&x.as_tensor().reshape((4, 256, 1, 8, 8))?, g)?;
    let (grads, peak) = peak_during(|| root.backward());
    let grads = grads?;
    let got = grads.get(&x).expect("x has a gradient");
    assert_eq!(got.dims(), shape);
    assert_eq!(got.flatten_all()?.to_vec1::<f32>()?, values, "the gradient is g itself");
    let gradient_bytes = (n * 4) as u64;
    assert!(
        peak < gradient_bytes / 2,
        "backward peaked {peak} B above its start: a copy of the {gradient_bytes} B gradient"
    );
    Ok(())
}
