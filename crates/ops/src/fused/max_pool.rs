//! Max pooling over the last two or three dimensions: keeps only its input; backward finds each
//! window's maximum again.

use super::generic::GenericOp;
use super::{exactly, shaped, slice, widened, with_slice, Elem, FusedOp, Operand};
use candle_core::{CpuStorage, Result, Shape, Tensor, Var};
use rayon::prelude::*;

/// Max-pooling over the last two dims of x (.., H, W): a k x k window, stride s, padding p (which
/// never wins). CPU f32/f64 only: check [`fused`](super::fused) first.
pub(crate) fn max_pool2d(x: &Tensor, k: usize, s: usize, p: usize) -> Result<Tensor> {
    max_pool(x, 2, k, s, p)
}

/// Max-pooling over the last three dims of x (.., D, H, W): a k x k x k window, stride s, padding
/// p. CPU f32/f64 only: check [`fused`](super::fused) first.
pub(crate) fn max_pool3d(x: &Tensor, k: usize, s: usize, p: usize) -> Result<Tensor> {
    max_pool(x, 3, k, s, p)
}

/// Max-pooling over the last `axes` dims of x. Keeps nothing but its input: backward finds each
/// window's maximum again (the first in row-major order, NaN winning, as PyTorch's kernels)
/// instead of holding indices (PyTorch keeps 8-byte indices, the composed pooling its partial
/// maxima).
fn max_pool(x: &Tensor, axes: usize, k: usize, s: usize, p: usize) -> Result<Tensor> {
    let r = x.rank();
    if r < axes || k == 0 || s == 0 || p >= k {
        candle_core::bail!(
            "max_pool{axes}d: needs rank >= {axes}, k >= 1, s >= 1 and p < k; got {:?}, k {k}, s \
             {s}, p {p}",
            x.dims()
        )
    }
    // A 2D pooling is a 3D one of depth 1 whose window has depth 1.
    let mut op =
        MaxPoolOp { axes, kernel: [1, k, k], stride: [1, s, s], pad: [0, p, p], input: [1; 3] };
    for a in 0..axes {
        let (at, n) = (3 - axes + a, x.dim(r - axes + a)?);
        (op.kernel[at], op.stride[at], op.pad[at], op.input[at]) = (k, s, p, n);
        if n + 2 * p < k {
            candle_core::bail!(
                "max_pool{axes}d: input {:?} padded by {p} is smaller than the window {k}",
                &x.dims()[r - axes..]
            )
        }
    }
    x.contiguous()?.apply_op1(op)
}

/// The generic route ([`super::generic`]) of a pooling `pool` composed from candle ops: the
/// composition on the detached input, and in backward candle's own backward of it, run again on a
/// copy of the input (candle differentiates only with respect to variables). Keeps what the kernel
/// keeps: its input. A window whose maximum is tied passes its gradient to every tied element
/// (shared where the pairwise `maximum` meets a tie), where the kernel passes it to the first; in
/// a network the ties are the zeros of a ReLU, whose gradient the ReLU then drops.
pub(crate) fn max_pool_generic(x: &Tensor, pool: fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let x_d = x.detach();
    // candle's maxima let a NaN lose; the kernel, as PyTorch, lets it win its windows.
    let nan_in_window = pool(&x_d.ne(&x_d)?.to_dtype(x.dtype())?)?.gt(0.0)?;
    let nan = Tensor::new(f32::NAN, x.device())?
        .to_dtype(x.dtype())?
        .broadcast_as(nan_in_window.shape())?;
    let y = nan_in_window.where_cond(&nan, &pool(&x_d)?)?;
    let backward = move |inputs: &[Tensor],
                         _y: &Tensor,
                         grad: &Tensor,
                         _want: &[bool]|
          -> Result<Vec<Option<Tensor>>> {
        let [x] = exactly(&inputs.iter().collect::<Vec<_>>())?;
        // In f32 for half precision: a gradient where windows overlap is a sum.
        let wide = Var::from_tensor(&widened(x)?)?;
        // d/dy of sum(y * grad) is grad, bit for bit.
        let grads = (pool(wide.as_tensor())? * widened(grad)?)?.sum_all()?.backward()?;
        Ok(vec![grads.get(wide.as_tensor()).map(|g| g.to_dtype(x.dtype())).transpose()?])
    };
    x.contiguous()?.apply_op1(GenericOp::new("generic-max-pool", y, Box::new(backward)))
}

/// Window, stride and padding along depth, height and width (depth 1, 1, 0 for a 2D pooling,
/// `axes` 2).
struct MaxPoolOp {
    axes: usize,
    kernel: [usize; 3],
    stride: [usize; 3],
    pad: [usize; 3],
    input: [usize; 3],
}

impl MaxPoolOp {
    fn out(&self) -> [usize; 3] {
        [0, 1, 2].map(|a| (self.input[a] + 2 * self.pad[a] - self.kernel[a]) / self.stride[a] + 1)
    }

    fn volume(v: [usize; 3]) -> usize {
        v.iter().product()
    }

    /// Calls `f(output index, input index of its window's maximum)` for every output of a volume
    /// (one sample's channel).
    fn argmax<T: Elem>(&self, vol: &[T], mut f: impl FnMut(usize, usize)) {
        let [od, oh, ow] = self.out();
        let [_, h, w] = self.input;
        // The input coordinates along axis `a` of the window that starts at output coordinate `at`.
        let window = |a: usize, at: usize| {
            (0..self.kernel[a]).filter_map(move |k| {
                (at * self.stride[a] + k).checked_sub(self.pad[a]).filter(|&v| v < self.input[a])
            })
        };
        for (o, (z, i, j)) in (0..od)
            .flat_map(|z| (0..oh).flat_map(move |i| (0..ow).map(move |j| (z, i, j))))
            .enumerate()
        {
            let mut best: Option<(usize, T)> = None;
            for zz in window(0, z) {
                for r in window(1, i) {
                    for c in window(2, j) {
                        let at = (zz * h + r) * w + c;
                        let v = vol[at];
                        if best.is_none_or(|(_, b)| v > b || v.is_nan()) {
                            best = Some((at, v));
                        }
                    }
                }
            }
            f(o, best.expect("p < k: every window holds an input").0);
        }
    }

    fn forward<T: Elem>(&self, x: &[T]) -> Vec<T> {
        let (vin, vout) = (Self::volume(self.input), Self::volume(self.out()));
        let mut y = vec![T::zero(); x.len() / vin * vout];
        y.par_chunks_mut(vout)
            .zip(x.par_chunks(vin))
            .for_each(|(y, x)| self.argmax(x, |o, i| y[o] = x[i]));
        y
    }

    fn backward<T: Elem>(&self, x: &[T], g: &[T]) -> Vec<T> {
        let (vin, vout) = (Self::volume(self.input), Self::volume(self.out()));
        let mut dx = vec![T::zero(); x.len()];
        dx.par_chunks_mut(vin)
            .zip(x.par_chunks(vin).zip(g.par_chunks(vout)))
            .for_each(|(dx, (x, g))| self.argmax(x, |o, i| dx[i] += g[o]));
        dx
    }
}

impl FusedOp for MaxPoolOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let [(s, l)] = exactly(inputs)?;
        let y = per_float!(s, "max_pool", self.forward(&slice(s, l)?));
        let mut dims = l.dims().to_vec();
        let r = dims.len();
        dims[r - self.axes..].copy_from_slice(&self.out()[3 - self.axes..]);
        Ok((y, Shape::from(dims)))
    }

    fn bwd(&self, inputs: &[&Tensor], _y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [x] = exactly(inputs)?;
        let g = g.contiguous()?;
        let dx = per_dtype!(x.dtype(), T => {
            let dx = with_slice::<T, _>(x, |xs| with_slice(&g, |gs| Ok(self.backward(xs, gs))))?;
            shaped(dx, x)?
        });
        Ok(vec![Some(dx)])
    }
}

custom_op!(MaxPoolOp: 1 "fused-max-pool");
