//! The convolutions a model runs, as it runs them: [`record_convolutions`] around a forward pass
//! lists each call (its kind, its operands' shapes, which of them needed a gradient), and
//! `ConvCall::call` (beside the convolutions) runs one again on other operands of those shapes.
//! The kernel bench (`bench-harness kernels`) times every convolution of its models this way,
//! so the shapes it times are the models' own, not a list typed beside them.

use crate::fused::Conv3dGeometry;
use candle_core::{DType, Tensor};
use std::cell::RefCell;

/// Which convolution op was called.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ConvKind {
    /// `conv2d`: operands x (N, C, H, W), w (O, C, kh, kw).
    Conv2d,
    /// `conv3d`: x (N, C, D, H, W), w (O, C, kd, kh, kw).
    Conv3d,
    /// `conv3d_concat`: a, b (N, Ca | Cb, D, H, W), w (O, Ca + Cb, kd, kh, kw).
    Conv3dConcat,
    /// `conv_transpose3d_k2s2`: x (N, C, D, H, W), w (C, O, 2, 2, 2), b (O).
    ConvTranspose3dK2S2,
}

/// One convolution call: its op, its operands' shapes in call order (the weight, and a bias,
/// last), its geometry, which operands needed a gradient, and the dtype.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ConvCall {
    pub kind: ConvKind,
    pub shapes: Vec<Vec<usize>>,
    /// (stride in depth, stride in-plane, padding in depth, padding in-plane).
    pub geometry: (usize, usize, usize, usize),
    /// Per operand: whether some variable led to it, so its gradient is computed in backward
    /// (a network's input image needs none).
    pub gradients: Vec<bool>,
    pub dtype: DType,
}

impl ConvKind {
    /// The op's name, as the kernel bench's reports and `scripts/torch_ops.py` spell it.
    pub fn name(self) -> &'static str {
        match self {
            ConvKind::Conv2d => "conv2d",
            ConvKind::Conv3d => "conv3d",
            ConvKind::Conv3dConcat => "conv3d-concat",
            ConvKind::ConvTranspose3dK2S2 => "conv-transpose3d-k2s2",
        }
    }
}

impl ConvCall {
    /// The operands that are data (the input, or the concatenation's two inputs), not weights.
    pub fn data_operands(&self) -> usize {
        match self.kind {
            ConvKind::Conv3dConcat => 2,
            _ => 1,
        }
    }

    /// Whether the model needed the gradient of its data (a network's input image needs none).
    pub fn needs_input_gradient(&self) -> bool {
        self.gradients[..self.data_operands()].iter().any(|&g| g)
    }

    /// Multiply-adds of its forward (a backward's input or weight gradient takes as many).
    pub fn macs(&self) -> u64 {
        let product = |s: &[usize]| s.iter().map(|&d| d as u64).product::<u64>();
        let weight = &self.shapes[self.data_operands()];
        match self.kind {
            // Every input voxel meets every weight entry once: N C DHW x O 8.
            ConvKind::ConvTranspose3dK2S2 => product(&self.shapes[0]) * product(&weight[1..]),
            // Every output voxel of every output channel: N O out x C k.
            _ => {
                let (s_d, s_hw, p_d, p_hw) = self.geometry;
                let x = &self.shapes[0];
                let spatial = x.len() - 2;
                let out: u64 = (0..spatial)
                    .map(|a| {
                        let (s, p) = if spatial == 3 && a == 0 { (s_d, p_d) } else { (s_hw, p_hw) };
                        ((x[2 + a] + 2 * p - weight[2 + a]) / s + 1) as u64
                    })
                    .product();
                x[0] as u64 * out * product(weight)
            }
        }
    }
}

thread_local! {
    /// The calls recorded on this thread, while [`record_convolutions`] runs.
    static CALLS: RefCell<Option<Vec<ConvCall>>> = const { RefCell::new(None) };
}

/// Runs `f` and returns what it returned with the convolutions it called on this thread, in
/// order (a call inside another, as `conv2d`'s `conv3d`, is not listed).
pub fn record_convolutions<R>(f: impl FnOnce() -> R) -> (R, Vec<ConvCall>) {
    let before = CALLS.with(|c| c.borrow_mut().replace(Vec::new()));
    let result = f();
    let calls = CALLS.with(|c| std::mem::replace(&mut *c.borrow_mut(), before));
    (result, calls.unwrap_or_default())
}

/// Records a call of `kind` on `operands` with `g` where [`record_convolutions`] runs, and runs
/// `f` with recording off (so an op that calls another is listed once).
pub(crate) fn recorded<R>(
    kind: ConvKind,
    operands: &[&Tensor],
    g: Conv3dGeometry,
    f: impl FnOnce() -> R,
) -> R {
    let recording = CALLS.with(|c| c.borrow_mut().take());
    let Some(mut calls) = recording else { return f() };
    calls.push(ConvCall {
        kind,
        shapes: operands.iter().map(|t| t.dims().to_vec()).collect(),
        geometry: (g.stride_d, g.stride_hw, g.pad_d, g.pad_hw),
        gradients: operands.iter().map(|t| t.track_op()).collect(),
        dtype: operands[0].dtype(),
    });
    let result = f();
    CALLS.with(|c| *c.borrow_mut() = Some(calls));
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// A forward pass's convolutions come back in order, each once (`conv2d` runs `conv3d`
    /// inside: listed as the 2D convolution it is), with which operands needed a gradient; run
    /// again, a recorded call gives what the model's call gave.
    #[test]
    fn a_forward_pass_lists_its_convolutions_and_replays_them() {
        let dev = Device::Cpu;
        let image = Tensor::ones((2, 3, 8, 8), DType::F32, &dev).unwrap();
        let w1 = Var::ones((4, 3, 3, 3), DType::F32, &dev).unwrap();
        let w2 = Var::ones((5, 4, 1, 1), DType::F32, &dev).unwrap();
        let forward = || -> candle_core::Result<Tensor> {
            let h = crate::conv2d(&image, &w1, 1, 2)?; // (2, 4, 4, 4)
            crate::conv2d(&h, &w2, 0, 1)
        };
        let (y, calls) = record_convolutions(forward);
        let y = y.unwrap();
        assert_eq!(calls.len(), 2, "{calls:?}");
        assert_eq!(
            (calls[0].kind, &calls[0].shapes, calls[0].geometry, &calls[0].gradients),
            (
                ConvKind::Conv2d,
                &vec![vec![2, 3, 8, 8], vec![4, 3, 3, 3]],
                (1, 2, 0, 1),
                &vec![false, true]
            )
        );
        assert_eq!(calls[1].gradients, vec![true, true], "the second layer's input has a graph");
        assert_eq!(calls[0].macs(), 2 * 4 * 4 * 4 * 3 * 3 * 3);
        assert_eq!(calls[1].macs(), 2 * 4 * 4 * 5 * 4);
        assert!(record_convolutions(|| ()).1.is_empty(), "a recording starts empty");
        let h = calls[0].call(&[image.clone(), w1.as_tensor().clone()]).unwrap();
        let again = calls[1].call(&[h, w2.as_tensor().clone()]).unwrap();
        assert_eq!(
            again.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            y.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
    }
}
