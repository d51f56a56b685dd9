//! Max pooling over the last two or three dimensions: keeps only its input; backward finds each
//! window's maximum again.

use crate::fused::dtype::widened;
use crate::fused::elem::Elem;
use crate::fused::generic::GenericOp;
use crate::fused::op::{exactly, FusedOp, Operand};
use crate::fused::storage::{shaped, slice, with_slice};
use candle_core::{CpuStorage, Result, Shape, Tensor, Var};
use rayon::prelude::*;
use std::ops::Range;

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

    /// The input coordinates along axis `a` of the window that starts at output coordinate `at`:
    /// the padding never wins, so it is left out.
    fn window(&self, a: usize, at: usize) -> Range<usize> {
        let start = at * self.stride[a];
        start.saturating_sub(self.pad[a])..(start + self.kernel[a] - self.pad[a]).min(self.input[a])
    }

    /// Calls `f(output index, input index of its window's maximum)` for every output of a volume
    /// (one sample's channel), row by row. In two steps, each input line read once however many
    /// windows share it: every line's maxima over the output columns' windows, then each output
    /// row's over its window's lines in order. The first maximum in row-major order wins, a NaN
    /// over anything before it: within a line, then between lines, as one pass over the window.
    fn argmax<T: Elem>(&self, vol: &[T], mut f: impl FnMut(usize, usize)) {
        let [od, oh, ow] = self.out();
        let [d, h, w] = self.input;
        let lines = d * h;
        assert!(vol.len() <= u32::MAX as usize, "a pooled volume's indices fit in u32");
        let (mut line_max, mut line_at) = (vec![T::zero(); lines * ow], vec![0u32; lines * ow]);
        // The columns whose windows lie inside the line are taken offset by offset, each offset's
        // candidates side by side from the line dealt into its stride's phases (candidate j of
        // offset t is phase (t - p) mod s's element j + (t - p) div s); the others one by one.
        let (s, p, k) = (self.stride[2], self.pad[2], self.kernel[2]);
        let end = (w + p).checked_sub(k).map_or(0, |last| last / s + 1).min(ow);
        let inner = p.div_ceil(s).min(end)..end;
        let phase_len = w.div_ceil(s);
        let (mut phases, mut phase_at) =
            (vec![T::zero(); s * phase_len], vec![0u32; s * phase_len]);
        for (c, a) in phase_at.iter_mut().enumerate() {
            *a = ((c % phase_len) * s + c / phase_len) as u32;
        }
        let rows = line_max.chunks_exact_mut(ow).zip(line_at.chunks_exact_mut(ow));
        for (l, (line, (max, at))) in vol.chunks_exact(w).zip(rows).enumerate() {
            for j in (0..ow).filter(|j| !inner.contains(j)) {
                let cs = self.window(2, j);
                let (mut best, mut m) = (cs.start, line[cs.start]);
                for c in cs {
                    (best, m) = if beats(line[c], m) { (c, line[c]) } else { (best, m) };
                }
                (max[j], at[j]) = (m, best as u32);
            }
            for (m, group) in line.chunks(s).enumerate() {
                group.iter().enumerate().for_each(|(q, &v)| phases[q * phase_len + m] = v);
            }
            let (max_in, at_in) = (&mut max[inner.clone()], &mut at[inner.clone()]);
            for t in 0..k {
                // t - p may be negative: shifted by k strides, then back.
                let (q, shifted) = ((t + s * k - p) % s, (t + s * k - p) / s);
                let from = q * phase_len + inner.start + shifted - k;
                let span = from..from + inner.len();
                if t == 0 {
                    max_in.copy_from_slice(&phases[span.clone()]);
                    at_in.copy_from_slice(&phase_at[span]);
                } else {
                    merge(max_in, at_in, &phases[span.clone()], &phase_at[span]);
                }
            }
            at.iter_mut().for_each(|a| *a += (l * w) as u32);
        }
        let (mut max, mut at) = (vec![T::zero(); ow], vec![0u32; ow]);
        let mut o = 0;
        for z in 0..od {
            for i in 0..oh {
                let mut window = self
                    .window(0, z)
                    .flat_map(|zz| self.window(1, i).map(move |r| (zz * h + r) * ow));
                let first = window.next().expect("p < k: every window holds an input");
                max.copy_from_slice(&line_max[first..first + ow]);
                at.copy_from_slice(&line_at[first..first + ow]);
                for l in window {
                    merge(&mut max, &mut at, &line_max[l..l + ow], &line_at[l..l + ow]);
                }
                at.iter().for_each(|&a| {
                    f(o, a as usize);
                    o += 1;
                });
            }
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

/// Where a candidate beats the maximum so far (is greater, or is a NaN: the last NaN wins, as
/// in one pass over the window), it and its index replace them. Side by side and without branches
/// on the values (random data mispredicts every other branch): the compiler makes the selects
/// blends only where it has AVX2's.
fn merge<T: Elem>(max: &mut [T], at: &mut [u32], candidates: &[T], candidates_at: &[u32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the processor has AVX2.
        return unsafe { merge_avx2(max, at, candidates, candidates_at) };
    }
    merge_any(max, at, candidates, candidates_at)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn merge_avx2<T: Elem>(
    max: &mut [T],
    at: &mut [u32],
    candidates: &[T],
    candidates_at: &[u32],
) {
    merge_any(max, at, candidates, candidates_at)
}

#[inline(always)]
fn merge_any<T: Elem>(max: &mut [T], at: &mut [u32], candidates: &[T], candidates_at: &[u32]) {
    let pairs = max.iter_mut().zip(at.iter_mut());
    for ((m, a), (&v, &i)) in pairs.zip(candidates.iter().zip(candidates_at)) {
        let wins = beats(v, *m);
        *a = if wins { i } else { *a };
        *m = if wins { v } else { *m };
    }
}

/// Whether `v`, met after `max` in a window, takes its place: it is greater, or a NaN (the last
/// NaN wins, as PyTorch's kernels). Both compares, `|` not `||`: one select, no branch.
#[inline(always)]
fn beats<T: Elem>(v: T, max: T) -> bool {
    (v > max) | v.is_nan()
}

#[cfg(test)]
mod tests {
    use super::MaxPoolOp;

    /// Each window's maximum by one pass over it in row-major order: the rule the two-step
    /// [`MaxPoolOp::argmax`] keeps.
    fn one_pass(op: &MaxPoolOp, vol: &[f32]) -> Vec<usize> {
        let ([od, oh, ow], [_, h, w]) = (op.out(), op.input);
        let mut winners = Vec::new();
        for z in 0..od {
            for i in 0..oh {
                for j in 0..ow {
                    let mut best: Option<(usize, f32)> = None;
                    for zz in op.window(0, z) {
                        for r in op.window(1, i) {
                            for c in op.window(2, j) {
                                let (at, v) = ((zz * h + r) * w + c, vol[(zz * h + r) * w + c]);
                                if best.is_none_or(|(_, b)| v > b || v.is_nan()) {
                                    best = Some((at, v));
                                }
                            }
                        }
                    }
                    winners.push(best.expect("a window holds an input").0);
                }
            }
        }
        winners
    }

    /// Ties everywhere (values 0..3, as a ReLU's zeros) and NaNs: the first maximum in row-major
    /// order wins, a NaN over anything before it, at every geometry the models use and odd ones.
    #[test]
    fn ties_and_nans_go_where_one_pass_sends_them() {
        let geometries = [
            ([1, 3, 3], [1, 2, 2], [0, 1, 1], [1, 9, 11]), // ResNet's stem pool, odd sides
            ([1, 3, 3], [1, 2, 2], [0, 1, 1], [1, 1, 1]),
            ([2, 2, 2], [2, 2, 2], [0, 0, 0], [6, 7, 9]), // the U-Net's pools
            ([1, 3, 3], [1, 1, 1], [0, 1, 1], [1, 5, 6]),
            ([1, 2, 4], [1, 3, 3], [0, 1, 2], [1, 7, 13]),
        ];
        for (kernel, stride, pad, input) in geometries {
            let op = MaxPoolOp { axes: 3, kernel, stride, pad, input };
            let vol: Vec<f32> = (0..input.iter().product::<usize>())
                .map(|i| if i % 17 == 5 { f32::NAN } else { ((i * 7919) % 4) as f32 })
                .collect();
            let mut winners = Vec::new();
            op.argmax(&vol, |o, at| {
                assert_eq!(o, winners.len(), "outputs in order");
                winners.push(at)
            });
            assert_eq!(winners, one_pass(&op, &vol), "{kernel:?} /{stride:?} p{pad:?} {input:?}");
        }
    }
}
