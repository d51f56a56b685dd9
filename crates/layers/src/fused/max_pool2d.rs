//! Max pooling over the last two dimensions: keeps only its input; backward finds each window's
//! maximum again.

use super::generic::GenericOp;
use super::{exactly, shaped, slice, widened, with_slice, Elem, FusedOp, Operand};
use candle_core::{CpuStorage, Result, Shape, Tensor, Var};
use rayon::prelude::*;

/// Max-pooling over the last two dims of x (.., H, W): a k x k window, stride s, padding p (which
/// never wins). Keeps nothing but its input: backward finds each window's maximum again (the first
/// in row-major order, NaN winning, as PyTorch's kernel) instead of holding indices. CPU f32/f64
/// only: check [`fused`](super::fused) first.
pub(crate) fn max_pool2d(x: &Tensor, k: usize, s: usize, p: usize) -> Result<Tensor> {
    let r = x.rank();
    if r < 2 || k == 0 || s == 0 || p >= k {
        candle_core::bail!("max_pool2d: needs rank >= 2, k >= 1, s >= 1 and p < k; got {:?}, k {k}, s {s}, p {p}", x.dims())
    }
    let (h, w) = (x.dim(r - 2)?, x.dim(r - 1)?);
    if h + 2 * p < k || w + 2 * p < k {
        candle_core::bail!("max_pool2d: input {h}x{w} padded by {p} is smaller than the window {k}")
    }
    x.contiguous()?.apply_op1(MaxPool2dOp { k, s, p, h, w })
}

/// The generic route ([`super::generic`]) of a pooling `pool` composed from candle ops: the
/// composition on the detached input, and in backward candle's own backward of it, run again on a
/// copy of the input (candle differentiates only with respect to variables). Keeps what the kernel
/// keeps: its input. A window whose maximum is tied passes its gradient to every tied element
/// (shared where the pairwise `maximum` meets a tie), where the kernel passes it to the first; in
/// a network the ties are the zeros of a ReLU, whose gradient the ReLU then drops.
pub(crate) fn max_pool2d_generic(x: &Tensor, pool: fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let x_d = x.detach();
    // candle's maxima let a NaN lose; the kernel, as PyTorch, lets it win its windows.
    let nan_in_window = pool(&x_d.ne(&x_d)?.to_dtype(x.dtype())?)?.gt(0.0)?;
    let nan = Tensor::new(f32::NAN, x.device())?.to_dtype(x.dtype())?.broadcast_as(nan_in_window.shape())?;
    let y = nan_in_window.where_cond(&nan, &pool(&x_d)?)?;
    let backward = move |inputs: &[Tensor], _y: &Tensor, grad: &Tensor| -> Result<Vec<Option<Tensor>>> {
        let [x] = exactly(&inputs.iter().collect::<Vec<_>>())?;
        // In f32 for half precision: a gradient where windows overlap is a sum.
        let wide = Var::from_tensor(&widened(x)?)?;
        // d/dy of sum(y * grad) is grad, bit for bit.
        let grads = (pool(wide.as_tensor())? * widened(grad)?)?.sum_all()?.backward()?;
        Ok(vec![grads.get(wide.as_tensor()).map(|g| g.to_dtype(x.dtype())).transpose()?])
    };
    x.contiguous()?.apply_op1(GenericOp::new("generic-max-pool2d", y, Box::new(backward)))
}

struct MaxPool2dOp {
    k: usize,
    s: usize,
    p: usize,
    h: usize,
    w: usize,
}

impl MaxPool2dOp {
    fn out(&self) -> (usize, usize) {
        ((self.h + 2 * self.p - self.k) / self.s + 1, (self.w + 2 * self.p - self.k) / self.s + 1)
    }

    /// Calls `f(output index, input index of its window's maximum)` for every output of a plane.
    fn argmax<T: Elem>(&self, plane: &[T], mut f: impl FnMut(usize, usize)) {
        let (ho, wo) = self.out();
        let inside = |at: usize, k: usize, n: usize| (at + k).checked_sub(self.p).filter(|&v| v < n);
        for i in 0..ho {
            for j in 0..wo {
                let mut best: Option<(usize, T)> = None;
                for r in (0..self.k).filter_map(|di| inside(i * self.s, di, self.h)) {
                    for c in (0..self.k).filter_map(|dj| inside(j * self.s, dj, self.w)) {
                        let v = plane[r * self.w + c];
                        if best.is_none_or(|(_, b)| v > b || v.is_nan()) {
                            best = Some((r * self.w + c, v));
                        }
                    }
                }
                f(i * wo + j, best.expect("p < k: every window holds an input").0);
            }
        }
    }

    fn forward<T: Elem>(&self, x: &[T]) -> Vec<T> {
        let (ho, wo) = self.out();
        let mut y = vec![T::zero(); x.len() / (self.h * self.w) * ho * wo];
        y.par_chunks_mut(ho * wo).zip(x.par_chunks(self.h * self.w)).for_each(|(y, x)| self.argmax(x, |o, i| y[o] = x[i]));
        y
    }

    fn backward<T: Elem>(&self, x: &[T], g: &[T]) -> Vec<T> {
        let (ho, wo) = self.out();
        let mut dx = vec![T::zero(); x.len()];
        dx.par_chunks_mut(self.h * self.w)
            .zip(x.par_chunks(self.h * self.w).zip(g.par_chunks(ho * wo)))
            .for_each(|(dx, (x, g))| self.argmax(x, |o, i| dx[i] += g[o]));
        dx
    }
}

impl FusedOp for MaxPool2dOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let [(s, l)] = exactly(inputs)?;
        let y = per_float!(s, "max_pool2d", self.forward(&slice(s, l)?));
        let mut dims = l.dims().to_vec();
        let r = dims.len();
        (dims[r - 2], dims[r - 1]) = self.out();
        Ok((y, Shape::from(dims)))
    }

    fn bwd(&self, inputs: &[&Tensor], _y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [x] = exactly(inputs)?;
        let g = g.contiguous()?;
        let dx = per_dtype!(x.dtype(), T => shaped(with_slice::<T, _>(x, |xs| with_slice(&g, |gs| Ok(self.backward(xs, gs))))?, x)?);
        Ok(vec![Some(dx)])
    }
}

custom_op!(MaxPool2dOp: 1 "fused-max-pool2d");
