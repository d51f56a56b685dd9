//! Every layer of this crate against central finite differences in f64, and the rules they cannot
//! see (tests/cases/gradients/), with the fused ops on their CPU kernels.

fn route() {
    ops::fused::set_path(ops::fused::Path::Kernel);
}

#[path = "cases/gradients/mod.rs"]
mod cases;

/// A batch of no samples gives a convolution's weight a zero gradient on both kernels that sum it
/// (the direct 3x3 and the pointwise of few voxels, whose sums its first term writes). Unchecked,
/// the direct sums were left unwritten and the pointwise one panicked sizing its runs.
#[test]
fn an_empty_batch_gives_zero_weight_gradients() -> candle_core::Result<()> {
    use candle_core::{DType, Device, Tensor, Var};
    route();
    let x = Tensor::zeros((0, 16, 4, 4), DType::F32, &Device::Cpu)?;
    for (k, padding) in [(3, 1), (1, 0)] {
        let w = Var::from_tensor(&Tensor::ones((32, 16, k, k), DType::F32, &Device::Cpu)?)?;
        let grads = ops::conv2d(&x, w.as_tensor(), padding, 1)?.sum_all()?.backward()?;
        let dw = grads.get(w.as_tensor()).expect("the weight trains");
        assert_eq!(dw.abs()?.max_all()?.to_scalar::<f32>()?, 0.0, "{k}x{k} kernel");
    }
    Ok(())
}
