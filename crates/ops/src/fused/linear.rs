//! Linear: `x @ w + b` as one op, so the product before the bias is not kept; keeps its inputs.
//! Of a GELU's output ([`gelu_linear`], [`LinearInput`]), keeping the GELU's input instead. And a
//! frozen linear layer with its LoRA adapter beside it as one op ([`lora_linear`]). Not here: the
//! layer that holds the parameters (the crate's `Linear`).

use crate::fused::dropout::DropoutOp;
use crate::fused::dtype::{is_half, operand, widened, widened_as};
use crate::fused::elem::{elem, Elem};
use crate::fused::gelu::{composed_backward, composed_forward, GeluForm, GeluOp};
use crate::fused::generic::GenericOp;
use crate::fused::matmul::{mat, matmul, matmul_new, Dest, Mat};
use crate::fused::op::{FusedOp, Operand};
use crate::fused::replay::{apply2, apply3, kept_or, Replay};
use crate::fused::route::{fused, generic, lean};
use crate::fused::storage::{shaped, slice, with_slice};
use crate::fused::uninit::uninit;
use candle_core::{CpuStorage, DType, Result, Shape, Tensor, D};
use params::WeightLayout;
use remat::keep::OpKind;
use std::borrow::Cow;

/// `x @ w + b` over the last dimension of x (.., in): `w` is stored as `layout` says, (in, out)
/// ([`WeightLayout::InOut`], GPT-2's `Conv1D`) or (out, in) ([`WeightLayout::OutIn`], Hugging
/// Face's `Linear`). One op: the product before the bias is no graph node, so it is not kept for
/// backward as `matmul` followed by `broadcast_add` keeps it.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>, layout: WeightLayout) -> Result<Tensor> {
    linear_of(x, LinearInput::AsIs, w, b, layout)
}

/// `linear(gelu(x, form), w, b, layout)`: an MLP's second projection and the activation before
/// it. On the CPU kernels one op that keeps x and never gelu(x), which its backward makes again
/// (one elementwise pass), as compiled PyTorch does (eager PyTorch keeps both); in f32 and f64 the
/// same bits as the two ops (in half precision gelu(x) is not rounded to it between them). On the
/// generic route the same composed in one op, keeping x; elsewhere the two ops.
pub fn gelu_linear(
    x: &Tensor,
    form: GeluForm,
    w: &Tensor,
    b: Option<&Tensor>,
    layout: WeightLayout,
) -> Result<Tensor> {
    linear_of(x, LinearInput::Gelu(form), w, b, layout)
}

/// [`linear`] of what `input` reads of x: the op of the kernels or the generic route, or where
/// neither applies, candle's ops.
fn linear_of(
    x: &Tensor,
    input: LinearInput,
    w: &Tensor,
    b: Option<&Tensor>,
    layout: WeightLayout,
) -> Result<Tensor> {
    if !lean(x) {
        return composed(&input.inside(x)?, &in_out(w, layout)?, b);
    }
    remat::keep::op(OpKind::Matmul, |kept| match generic(x) {
        true => linear_generic(x, input, w, b.map_or(Third::None, Third::Bias), layout, kept),
        false => linear_kernel(x, input, (w, b), layout, kept),
    })
}

/// The CPU kernel's op of [`linear`] and [`gelu_linear`].
fn linear_kernel(
    x: &Tensor,
    input: LinearInput,
    (w, b): (&Tensor, Option<&Tensor>),
    layout: WeightLayout,
    kept: Option<Tensor>,
) -> Result<Tensor> {
    let (x, w) = (x.contiguous()?, operand(w, x)?);
    let op = LinearOp { layout, input };
    match b {
        Some(b) => apply3(&x, &w, &operand(b, &x)?, op, kept),
        None => apply2(&x, &w, op, kept),
    }
}

/// What a linear op's product reads: its input operand, or a GELU of it (an MLP's activation),
/// which the op makes in forward and again in backward, so that it is never kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearInput {
    AsIs,
    Gelu(GeluForm),
}

impl LinearInput {
    /// What the product reads of x's elements: x itself, or gelu(x) (a transient).
    fn apply<T: Elem>(self, x: &[T]) -> Cow<'_, [T]> {
        match self {
            LinearInput::AsIs => Cow::Borrowed(x),
            LinearInput::Gelu(form) => Cow::Owned(GeluOp { form }.map(x, None)),
        }
    }

    /// What a backward needs of x: with `d` (the gradient of what the product read) x's gradient,
    /// and where `read`, what the product read (as [`LinearInput::apply`]). A GELU wanted both
    /// ways is made in one pass with its gradient; neither is made where it is not wanted.
    fn backward<T: Elem>(
        self,
        x: &[T],
        d: Option<Vec<T>>,
        read: bool,
    ) -> (Option<Cow<'_, [T]>>, Option<Vec<T>>) {
        match (self, d) {
            (LinearInput::Gelu(form), Some(d)) if read => {
                let (y, dx) = GeluOp { form }.map_both(x, d);
                (Some(Cow::Owned(y)), Some(dx))
            }
            (LinearInput::Gelu(form), Some(d)) => (None, Some(GeluOp { form }.map(x, Some(&d)))),
            (_, d) => (read.then(|| self.apply(x)), d),
        }
    }

    /// What the product reads of x, composed from candle's ops: inside a generic route's op (on a
    /// detached x in the compute dtype), or where no op of ours applies.
    fn inside(self, x: &Tensor) -> Result<Tensor> {
        match self {
            LinearInput::AsIs => Ok(x.clone()),
            LinearInput::Gelu(form) => composed_forward(x, form),
        }
    }

    /// x's gradient from `d` inside a generic route's op, as [`LinearInput::backward`].
    fn backward_inside(self, x: &Tensor, d: Tensor) -> Result<Tensor> {
        match self {
            LinearInput::AsIs => Ok(d),
            LinearInput::Gelu(form) => composed_backward(x, &d, form),
        }
    }
}

/// `r + x @ w` over the last dimension of x, w stored as `layout` says: a residual branch's last
/// projection and the addition that ends it (Llama's `o_proj` and `down_proj`), as one op. The
/// product is no graph node, so it is not kept for backward as `r + linear(x, w)` keeps it (an
/// addition's node holds both its operands until backward).
pub fn linear_residual(x: &Tensor, w: &Tensor, r: &Tensor, layout: WeightLayout) -> Result<Tensor> {
    if !lean(x) {
        return r + composed(x, &in_out(w, layout)?, None)?;
    }
    let base = LinearOp { layout, input: LinearInput::AsIs };
    let product = base.out_shape(x.shape(), w.shape());
    if r.shape() != &product || r.dtype() != x.dtype() {
        candle_core::bail!(
            "linear_residual: a residual of {:?} {:?} for a product of {product:?} {:?}",
            r.dims(),
            r.dtype(),
            x.dtype()
        )
    }
    remat::keep::op(OpKind::Matmul, |kept| {
        let (x, r) = (x.contiguous()?, r.contiguous()?);
        if generic(&x) {
            return linear_generic(&x, LinearInput::AsIs, w, Third::Residual(&r), layout, kept);
        }
        apply3(&x, &operand(w, &x)?, &r, LinearResidualOp { base }, kept)
    })
}

/// What a linear op's third operand is, where it has one.
#[derive(Clone, Copy)]
enum Third<'a> {
    None,
    /// Added to each row: the bias.
    Bias(&'a Tensor),
    /// Added to the product: the residual ([`linear_residual`]).
    Residual(&'a Tensor),
}

/// [`linear`] (of `input`) on the generic route; `kept`: its output, kept from the forward
/// (`remat::keep`).
fn linear_generic(
    x: &Tensor,
    input: LinearInput,
    w: &Tensor,
    third: Third,
    layout: WeightLayout,
    kept: Option<Tensor>,
) -> Result<Tensor> {
    let k = x.dim(D::Minus1)?;
    let y = kept_or(kept, || {
        // In f32 for half precision (an f32 weight may meet a bf16 input), stored in x's dtype.
        let w_in = in_out(w, layout)?;
        let x32 = input.inside(&widened(&x.detach())?)?;
        let like_x32 = |t: &Tensor| widened_as(&t.detach(), x);
        match third {
            Third::None => composed(&x32, &like_x32(&w_in)?, None)?,
            Third::Bias(b) => composed(&x32, &like_x32(&w_in)?, Some(&like_x32(b)?))?,
            Third::Residual(r) => (like_x32(r)? + composed(&x32, &like_x32(&w_in)?, None)?)?,
        }
        .to_dtype(x.dtype())
    })?;
    // dx = g w_in^T, dw_in = x^T g (transposed back for an (out, in) w), db = the rows' sum of g,
    // dr = g. Only the gradients wanted: a frozen weight's is not computed.
    let residual = matches!(third, Third::Residual(_));
    let backward = move |inputs: &[Tensor],
                         _: &Tensor,
                         g: &Tensor,
                         want: &[bool]|
          -> Result<Vec<Option<Tensor>>> {
        let (x, w) = (&inputs[0], &inputs[1]);
        let rows = x.elem_count() / k;
        let g32 = widened(g)?;
        let g2 = g32.reshape((rows, g32.elem_count() / rows))?;
        let dx = || -> Result<Tensor> {
            let w_in = widened_as(&in_out(w, layout)?, g)?;
            let d = g2.matmul(&w_in.t()?)?.reshape(x.shape())?;
            input.backward_inside(x, d)?.to_dtype(x.dtype())
        };
        let dw = || -> Result<Tensor> {
            let xa = input.inside(&widened_as(x, g)?)?;
            let dw_in = xa.reshape((rows, k))?.t()?.matmul(&g2)?;
            match layout {
                WeightLayout::OutIn => dw_in.t()?.contiguous()?,
                WeightLayout::InOut => dw_in,
            }
            .to_dtype(w.dtype())
        };
        let mut grads = vec![want[0].then(dx).transpose()?, want[1].then(dw).transpose()?];
        if let Some(t) = inputs.get(2) {
            let third = || match residual {
                true => g.to_dtype(t.dtype()),
                false => g2.sum(0)?.to_dtype(t.dtype()),
            };
            grads.push(want[2].then(third).transpose()?);
        }
        Ok(grads)
    };
    let name = match third {
        Third::None => "generic-linear",
        Third::Bias(_) => "generic-linear-bias",
        Third::Residual(_) => "generic-linear-residual",
    };
    let op = GenericOp::new(name, y, Box::new(backward));
    let x = x.contiguous()?;
    match third {
        Third::None => x.apply_op2(w, op),
        Third::Bias(t) | Third::Residual(t) => x.apply_op3(w, t, op),
    }
}

/// The weight `w`, stored as `layout` says, as the (in, out) matrix `x @ w_in` takes: itself, or
/// its transpose (a view).
fn in_out(w: &Tensor, layout: WeightLayout) -> Result<Tensor> {
    match layout {
        WeightLayout::OutIn => w.t(),
        WeightLayout::InOut => Ok(w.clone()),
    }
}

/// `x @ w_in + b` from candle's ops, over the last dimension of x.
fn composed(x: &Tensor, w_in: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let k = x.dim(D::Minus1)?;
    let rows = x.elem_count() / k;
    let y = x.reshape((rows, k))?.matmul(w_in)?;
    let y = match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("rank >= 1") = y.dim(1)?;
    y.reshape(dims)
}

#[derive(Clone, Copy)]
struct LinearOp {
    layout: WeightLayout,
    input: LinearInput,
}

impl LinearOp {
    /// The stored weight `w` as the (in, out) operand `w_in` of `x @ w_in`: an (out, in) weight
    /// read transposed, in place.
    fn w_in<'w, T>(&self, w: &'w [T]) -> Mat<'w, T> {
        match self.layout {
            WeightLayout::OutIn => mat(w).transposed(),
            WeightLayout::InOut => mat(w),
        }
    }

    /// `x @ w_in + b` of x's rows of `k`.
    fn forward<T: Elem>(&self, x: &[T], k: usize, w: &[T], b: Option<&[T]>) -> Vec<T> {
        let (rows, n) = (x.len() / k, w.len() / k);
        let (y, dest) = match b {
            Some(b) => (b.repeat(rows), Dest::Accumulate),
            // SAFETY: the product overwrites every element.
            None => (unsafe { uninit(rows * n) }, Dest::Overwrite),
        };
        // y = b + x @ w_in, the bias added first: as one product accumulated onto it.
        self.onto(y, x, k, w, dest)
    }

    /// `y (+)= x @ w_in` of x's rows of `k`, as `dest` says.
    fn onto<T: Elem>(&self, mut y: Vec<T>, x: &[T], k: usize, w: &[T], dest: Dest) -> Vec<T> {
        let (rows, n) = (x.len() / k, w.len() / k);
        matmul(&mut y, mat(x), self.w_in(w), (rows, k, n), dest);
        y
    }

    /// The output's shape: x's, its last dimension the weight's output size.
    fn out_shape(&self, x: &Shape, w: &Shape) -> Shape {
        let mut dims = x.dims().to_vec();
        *dims.last_mut().expect("rank >= 1") = match self.layout {
            WeightLayout::OutIn => w.dims()[0],
            WeightLayout::InOut => w.dims()[1],
        };
        Shape::from(dims)
    }
}

/// Operands x, w and, at arity 3, the bias.
impl FusedOp for LinearOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let ((x, xl), (w, wl), b) = (inputs[0], inputs[1], inputs.get(2));
        let y = per_float!(
            x,
            "linear",
            self.forward(
                &self.input.apply(&slice(x, xl)?),
                *xl.dims().last().expect("rank >= 1"),
                &slice(w, wl)?,
                b.map(|&(s, l)| slice(s, l)).transpose()?.as_deref()
            )
        );
        Ok((y, self.out_shape(xl.shape(), wl.shape())))
    }

    /// dx = g w_in^T, dw = x^T g (as g^T x for an (out, in) weight), db = column sums of g; each
    /// only for an operand some variable leads to (a frozen weight gets none, not even computed).
    /// Of a GELU's output: dw from the GELU made again, dx through the GELU's slope.
    fn bwd(&self, inputs: &[&Tensor], _y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let (x, w, b) = (inputs[0], inputs[1], inputs.get(2));
        let k = x.dim(D::Minus1)?;
        let (rows, n) = (x.elem_count() / k, w.elem_count() / k);
        let g = g.contiguous()?;
        let (dx, dw) = per_dtype!(x.dtype(), T => {
            let (dx, dw) = with_slice::<T, _>(x, |xs| with_slice(w, |ws| with_slice(&g, |gs| {
                // w_in^T is the stored w read the other way round.
                let d = x.track_op().then(|| {
                    matmul_new(mat(gs), self.w_in(ws).transposed(), (rows, n, k))
                });
                let (xa, dx) = self.input.backward(xs, d, w.track_op());
                let dw = xa.map(|xa| match self.layout {
                    WeightLayout::OutIn => {
                        matmul_new(mat(gs).transposed(), mat(&xa), (n, rows, k))
                    }
                    WeightLayout::InOut => {
                        matmul_new(mat(&xa).transposed(), mat(gs), (k, rows, n))
                    }
                });
                Ok((dx, dw))
            })))?;
            (dx.map(|dx| shaped(dx, x)).transpose()?, dw.map(|dw| shaped(dw, w)).transpose()?)
        });
        let Some(b) = b.filter(|b| b.track_op()) else {
            return Ok([dx, dw].into_iter().chain(b.map(|_| None)).collect());
        };
        // The bias gradient summed in f32 at least (candle would sum a bf16 g in bf16).
        let g = if is_half(g.dtype()) { g.to_dtype(DType::F32)? } else { g };
        Ok(vec![dx, dw, Some(g.reshape((rows, n))?.sum(0)?.to_dtype(b.dtype())?)])
    }
}

custom_op!(LinearOp: 2 "fused-linear", 3 "fused-linear-bias");
custom_op!(Replay<LinearOp>: 2 "replayed-linear", 3 "replayed-linear-bias");

/// [`linear_residual`] on the CPU, over x, w and the residual r: [`LinearOp`]'s product
/// accumulated onto a copy of r, its gradients and r's (the output's, as it is).
struct LinearResidualOp {
    base: LinearOp,
}

impl FusedOp for LinearResidualOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let [(x, xl), (w, wl), (r, rl)] = crate::fused::op::exactly(inputs)?;
        let k = *xl.dims().last().expect("rank >= 1");
        let y = per_float!(x, "linear_residual", {
            let r = slice(r, rl)?.into_owned();
            self.base.onto(r, &slice(x, xl)?, k, &slice(w, wl)?, Dest::Accumulate)
        });
        Ok((y, self.base.out_shape(xl.shape(), wl.shape())))
    }

    fn bwd(&self, inputs: &[&Tensor], y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let r = inputs[2];
        let mut grads = self.base.bwd(&inputs[..2], y, g)?;
        grads.push(r.track_op().then(|| g.to_dtype(r.dtype())).transpose()?);
        Ok(grads)
    }
}

custom_op!(LinearResidualOp: 3 "fused-linear-residual");
custom_op!(Replay<LinearResidualOp>: 3 "replayed-linear-residual");

/// A frozen linear layer with a LoRA adapter beside it, as one op over `x`, `a` (r, in) and
/// `b_lora` (out, r): `x @ w + b + scale * dropout(x) @ a^T @ b_lora^T`. The frozen weight and bias
/// are no operands (they get no gradient), so the op keeps only `x` and the adapter's weights:
/// composed from candle's ops, the base output, the adapter's output and their sum would all stay
/// in candle's graph until backward, several activations of the layer's output size more than
/// full fine-tuning keeps. `dropout`: the key and probability of the adapter's input dropout, its
/// mask drawn again in backward. `input`: what the layer reads of `x`, `x` itself or a GELU of it
/// (as [`gelu_linear`]: then the op keeps `x` and never the GELU's output). On the CPU a kernel
/// (`LoraLinearOp`: the adapter's product added into the base product's output, no full-size
/// temporary); elsewhere composed from candle's ops, in f32 (in f64 for f64).
pub fn lora_linear(
    x: &Tensor,
    input: LinearInput,
    (w, b): (&Tensor, Option<&Tensor>),
    layout: WeightLayout,
    (a, b_lora, scale): (&Tensor, &Tensor, f64),
    dropout: Option<(remat::rng::RngKey, f32)>,
) -> Result<Tensor> {
    if fused(x) {
        let (w, bias) = (w.detach(), b.map(Tensor::detach));
        let op = LoraLinearOp { w, bias, layout, input, scale, dropout };
        let (x, a, b_lora) = (x.contiguous()?, a.contiguous()?, b_lora.contiguous()?);
        return remat::keep::op(OpKind::Matmul, move |kept| apply3(&x, &a, &b_lora, op, kept));
    }
    let k = x.dim(D::Minus1)?;
    // In f32 for half precision, else in x's dtype.
    let f32 = |t: &Tensor| widened_as(&t.detach(), x);
    // (in, out) as stored, widened only where used: a bf16 base held widened from forward to
    // backward would be an f32 copy of a frozen weight.
    let w_in = in_out(&w.detach(), layout)?;
    let bias = b.map(f32).transpose()?;
    let dropped = move |x2: &Tensor| -> Result<Tensor> {
        match dropout {
            Some((key, p)) => x2 * key.dropout_mask_like(x2, p)?,
            None => Ok(x2.clone()),
        }
    };
    let rows = x.elem_count() / k;
    let mut out_shape = x.dims().to_vec();
    *out_shape.last_mut().expect("x has a last dimension") = w_in.dim(1)?;
    remat::keep::op(OpKind::Matmul, move |kept| {
        let y = kept_or(kept, || {
            let x2 = input.inside(&f32(x)?)?.reshape((rows, k))?;
            let y = x2.matmul(&f32(&w_in)?)?;
            let y = match &bias {
                Some(bias) => y.broadcast_add(bias)?,
                None => y,
            };
            let h = dropped(&x2)?.matmul(&f32(a)?.t()?)?; // (rows, r)
            (y + h.matmul(&f32(b_lora)?.t()?)?.affine(scale, 0.0)?)?
                .reshape(out_shape)?
                .to_dtype(x.dtype())
        })?;
        // g (rows, out): dx = g w_in^T + mask * (scale g B A), dA = scale (g B)^T dropout(x),
        // dB = scale g^T (dropout(x) A^T).
        let backward = move |inputs: &[Tensor],
                             _: &Tensor,
                             g: &Tensor,
                             want: &[bool]|
              -> Result<Vec<Option<Tensor>>> {
            let (x, a, b_lora) = (&inputs[0], &inputs[1], &inputs[2]);
            let g2 = widened_as(g, x)?.reshape((rows, g.elem_count() / rows))?;
            let (a32, b32) = (widened_as(a, x)?, widened_as(b_lora, x)?);
            let xd = dropped(&input.inside(&widened(x)?)?.reshape((rows, k))?)?;
            let gb = g2.matmul(&b32)?.affine(scale, 0.0)?; // (rows, r)
            let dx = || -> Result<Tensor> {
                let d = (g2.matmul(&widened_as(&w_in, x)?.t()?)? + dropped(&gb.matmul(&a32)?)?)?
                    .reshape(x.shape())?;
                input.backward_inside(x, d)?.to_dtype(x.dtype())
            };
            let da = || -> Result<Tensor> { gb.t()?.matmul(&xd)?.to_dtype(a.dtype()) };
            let db = || -> Result<Tensor> {
                g2.t()?.matmul(&xd.matmul(&a32.t()?)?)?.affine(scale, 0.0)?.to_dtype(b_lora.dtype())
            };
            Ok(vec![
                want[0].then(dx).transpose()?,
                want[1].then(da).transpose()?,
                want[2].then(db).transpose()?,
            ])
        };
        x.contiguous()?.apply_op3(a, b_lora, GenericOp::new("lora-linear", y, Box::new(backward)))
    })
}

/// [`lora_linear`] on the CPU, over the operands x, a (r, in) and b_lora (out, r); the frozen
/// weight and bias are the op's own (no operands: no gradient, nothing of theirs computed).
struct LoraLinearOp {
    w: Tensor,
    bias: Option<Tensor>,
    layout: WeightLayout,
    input: LinearInput,
    scale: f64,
    dropout: Option<(remat::rng::RngKey, f32)>,
}

impl LoraLinearOp {
    fn base(&self) -> LinearOp {
        LinearOp { layout: self.layout, input: LinearInput::AsIs }
    }

    /// The adapter's input: dropout(x), or x itself.
    fn dropped<'x, T: Elem>(&self, x: &'x [T]) -> Cow<'x, [T]> {
        match self.dropout {
            Some((key, p)) => {
                let mut v = x.to_vec();
                DropoutOp { key, p }.mask_in_place(&mut v);
                Cow::Owned(v)
            }
            None => Cow::Borrowed(x),
        }
    }

    /// `scale * xd @ a^T` (rows, r) of the adapter's input xd.
    fn down<T: Elem>(&self, xd: &[T], a: &[T], k: usize) -> Vec<T> {
        let (rows, r) = (xd.len() / k, a.len() / k);
        let mut h = matmul_new(mat(xd), mat(a).transposed(), (rows, k, r));
        let scale = elem::<T>(self.scale);
        h.iter_mut().for_each(|v| *v *= scale);
        h
    }

    /// y = x @ w_in + bias + (scale dropout(x) @ a^T) @ b^T, the adapter's product added into the
    /// base's output.
    fn forward<T: Elem>(
        &self,
        x: &[T],
        k: usize,
        w: &[T],
        bias: Option<&[T]>,
        (a, b): (&[T], &[T]),
    ) -> Vec<T> {
        let mut y = self.base().forward(x, k, w, bias);
        let h = self.down(&self.dropped(x), a, k);
        let (rows, r) = (x.len() / k, a.len() / k);
        let n = b.len() / r; // b: (out, r)
        matmul(&mut y, mat(&h), mat(b).transposed(), (rows, r, n), Dest::Accumulate);
        y
    }
}

/// With gb = scale g @ b: dx = g w_in^T + dropout(gb @ a), da = gb^T dropout(x),
/// db = g^T (scale dropout(x) @ a^T); each only where wanted. Of a GELU's output, x here is the
/// GELU made again, and dx goes through its slope.
impl FusedOp for LoraLinearOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let [(x, xl), (a, al), (b, bl)] = crate::fused::op::exactly(inputs)?;
        let k = *xl.dims().last().expect("rank >= 1");
        let y = per_float!(x, "lora_linear", {
            let (x, a, b) = (slice(x, xl)?, slice(a, al)?, slice(b, bl)?);
            let x = self.input.apply(&x);
            let bias = self.bias.as_ref().map(|t| with_slice(t, |v| Ok(v.to_vec()))).transpose()?;
            with_slice(&self.w, |w| Ok(self.forward(&x, k, w, bias.as_deref(), (&a, &b))))?
        });
        let mut dims = xl.dims().to_vec();
        *dims.last_mut().expect("rank >= 1") = bl.dims()[0];
        Ok((y, Shape::from(dims)))
    }

    fn bwd(&self, inputs: &[&Tensor], _y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [x, a, b] = crate::fused::op::exactly(inputs)?;
        let k = x.dim(D::Minus1)?;
        let (rows, (n, r)) = (x.elem_count() / k, b.dims2()?);
        let g = g.contiguous()?;
        per_dtype!(x.dtype(), T => {
            let grads = with_slice::<T, _>(x, |xs| with_slice(a, |a_s| with_slice(b, |bs| {
                with_slice(&g, |gs| with_slice(&self.w, |ws| {
                    let mut gb = matmul_new(mat(gs), mat(bs), (rows, n, r)); // (rows, r)
                    let scale = elem::<T>(self.scale);
                    gb.iter_mut().for_each(|v| *v *= scale);
                    let d = x.track_op().then(|| {
                        let w_in_t = self.base().w_in(ws).transposed();
                        let mut dx = matmul_new(mat(gs), w_in_t, (rows, n, k));
                        match self.dropout {
                            None => matmul(&mut dx, mat(&gb), mat(a_s), (rows, r, k), Dest::Accumulate),
                            Some((key, p)) => {
                                let mut t = matmul_new(mat(&gb), mat(a_s), (rows, r, k));
                                DropoutOp { key, p }.mask_in_place(&mut t);
                                dx.iter_mut().zip(&t).for_each(|(d, &v)| *d += v);
                            }
                        }
                        dx
                    });
                    let (xa, dx) = self.input.backward(xs, d, a.track_op() || b.track_op());
                    let xd = xa.as_deref().map(|xa| self.dropped(xa));
                    let da = xd.as_deref().filter(|_| a.track_op())
                        .map(|xd| matmul_new(mat(&gb).transposed(), mat(xd), (r, rows, k)));
                    let db = xd.as_deref().filter(|_| b.track_op()).map(|xd| {
                        let h = self.down(xd, a_s, k);
                        matmul_new(mat(gs).transposed(), mat(&h), (n, rows, r))
                    });
                    Ok((dx, da, db))
                }))
            })))?;
            let (dx, da, db) = grads;
            Ok(vec![
                dx.map(|v| shaped(v, x)).transpose()?,
                da.map(|v| shaped(v, a)).transpose()?,
                db.map(|v| shaped(v, b)).transpose()?,
            ])
        })
    }
}

custom_op!(LoraLinearOp: 3 "fused-lora-linear");
custom_op!(Replay<LoraLinearOp>: 3 "replayed-lora-linear");
