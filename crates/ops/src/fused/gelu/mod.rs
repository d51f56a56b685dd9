//! GELU, tanh or erf ([`GeluForm`]): keeps its input, as candle's does, with a one-pass,
//! multi-threaded backward; f32 by vectorised formulas (`vector`), f64 one element at a time.
//! Not here: the layers it follows (the models' crates).

mod vector;

use crate::fused::dtype::widened;
use crate::fused::elem::{elem, wide, Elem};
use crate::fused::generic::GenericOp;
use crate::fused::op::{exactly, FusedOp, Operand};
use crate::fused::parallel::ELEMENT_CHUNK;
use crate::fused::route::{fused, generic};
use crate::fused::storage::{shaped, slice, with_slice};
use crate::fused::uninit::uninit;
use candle_core::{CpuStorage, Result, Shape, Tensor};
use rayon::prelude::*;

/// Which GELU: `x cdf(x)` exact, or its tanh approximation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GeluForm {
    /// The tanh approximation, GPT-2's `gelu_new` (candle's `gelu`).
    Tanh,
    /// Exact, with erf: BERT's `gelu` (candle's `gelu_erf`).
    Erf,
}

/// GELU in the form `form`, in parallel: f32 (and half precision, read as f32) many elements at
/// once within a few ulp of the exact value, f64 one by one. Keeps its input, as candle's does,
/// but its backward is one pass where candle's composes about ten tensors of the input's size.
pub fn gelu(x: &Tensor, form: GeluForm) -> Result<Tensor> {
    if generic(x) {
        // In f32 for half precision, stored in x's dtype, as the kernel.
        let x32 = widened(&x.detach())?;
        let y = composed_forward(&x32, form)?.to_dtype(x.dtype())?;
        drop(x32);
        let backward = move |inputs: &[Tensor],
                             _: &Tensor,
                             g: &Tensor,
                             _want: &[bool]|
              -> Result<Vec<Option<Tensor>>> {
            Ok(vec![Some(composed_backward(&inputs[0], g, form)?)])
        };
        return x.contiguous()?.apply_op1(GenericOp::new("generic-gelu", y, Box::new(backward)));
    }
    if !fused(x) {
        return composed_forward(x, form);
    }
    x.contiguous()?.apply_op1(GeluOp { form })
}

/// GELU of x by candle's own ops, in x's dtype: the generic route's forward, and the op where
/// neither route applies.
pub(crate) fn composed_forward(x: &Tensor, form: GeluForm) -> Result<Tensor> {
    match form {
        GeluForm::Erf => x.gelu_erf(),
        GeluForm::Tanh => x.gelu(),
    }
}

/// GELU's input gradient g gelu'(x) composed from candle's ops (the generic route's backward), in
/// f32 for half precision, in g's dtype.
pub(crate) fn composed_backward(x: &Tensor, g: &Tensor, form: GeluForm) -> Result<Tensor> {
    let x = widened(x)?;
    // Operators on owned tensors drop their operands as they go; a chain of methods would keep
    // every intermediate to the end of its statement.
    let derivative = if form == GeluForm::Erf {
        // cdf(x) + x pdf(x)
        let cdf = (&x / std::f64::consts::SQRT_2)?.erf()?.affine(0.5, 0.5)?;
        let pdf = ((x.sqr()? * -0.5)?.exp()? * (2.0 * std::f64::consts::PI).sqrt().recip())?;
        (cdf + (pdf * &x)?)?
    } else {
        // 0.5 (1 + t) + 0.5 c x (1 - t^2) (1 + 3 k x^2), t = tanh(c x (1 + k x^2))
        let x2 = x.sqr()?;
        let poly = x2.affine(3.0 * 0.044_715, 1.0)?;
        let u = (x2.affine(0.044_715, 1.0)? * &x)?;
        drop(x2);
        let t = (u * SQRT_2_OVER_PI)?.tanh()?;
        let slope = ((t.sqr()?.affine(-0.5 * SQRT_2_OVER_PI, 0.5 * SQRT_2_OVER_PI)? * &x)? * poly)?;
        (t.affine(0.5, 0.5)? + slope)?
    };
    (widened(g)? * derivative)?.to_dtype(g.dtype())
}

pub(crate) struct GeluOp {
    pub(crate) form: GeluForm,
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

impl GeluOp {
    /// (gelu(x), gelu'(x)) of an f64 element.
    fn eval(&self, x: f64) -> (f64, f64) {
        if self.form == GeluForm::Erf {
            let cdf = 0.5 * (1.0 + candle_core::cpu::erf::erf_f64(x / std::f64::consts::SQRT_2));
            let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
            (x * cdf, cdf + x * pdf)
        } else {
            let inner = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
            let t = inner.tanh();
            let d_inner = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x);
            (0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner)
        }
    }

    /// gelu(x), or with `g` the gradient g gelu'(x); in chunks, in parallel.
    pub(crate) fn map<T: Elem>(&self, x: &[T], g: Option<&[T]>) -> Vec<T> {
        // SAFETY: `chunk` writes every element.
        let mut y = unsafe { uninit::<T>(x.len()) };
        y.par_chunks_mut(ELEMENT_CHUNK).enumerate().for_each(|(c, y)| {
            let at = c * ELEMENT_CHUNK..c * ELEMENT_CHUNK + y.len();
            self.chunk(&x[at.clone()], g.map(|g| &g[at]), y);
        });
        y
    }

    /// (gelu(x), g gelu'(x)) in one pass, the gradient written over `g`: the same bits as
    /// [`Self::map`] twice, in one buffer fewer. What a layer that makes the GELU again in backward
    /// needs (`fused::linear`'s `LinearInput::Gelu`).
    pub(crate) fn map_both<T: Elem>(&self, x: &[T], mut g: Vec<T>) -> (Vec<T>, Vec<T>) {
        // SAFETY: each chunk's pass writes every element.
        let mut y = unsafe { uninit::<T>(x.len()) };
        let chunks = y.par_chunks_mut(ELEMENT_CHUNK).zip(g.par_chunks_mut(ELEMENT_CHUNK));
        chunks.enumerate().for_each(|(c, (y, g))| {
            let x = &x[c * ELEMENT_CHUNK..c * ELEMENT_CHUNK + y.len()];
            if let (Some(xf), Some(gf), Some(yf)) = (T::f32s(x), T::f32s_mut(g), T::f32s_mut(y)) {
                return vector::gelu_and_backward(self.form, xf, gf, yf);
            }
            for i in 0..y.len() {
                let (value, slope) = self.eval(wide(x[i]));
                (y[i], g[i]) = (elem(value), elem(wide(g[i]) * slope));
            }
        });
        (y, g)
    }

    /// One chunk of [`Self::map`] into `y`: f32 by the vectorised formulas, f64 by [`Self::eval`].
    fn chunk<T: Elem>(&self, x: &[T], g: Option<&[T]>, y: &mut [T]) {
        if let (Some(x), Some(y)) = (T::f32s(x), T::f32s_mut(y)) {
            return match g.and_then(T::f32s) {
                None => vector::gelu(self.form, x, y),
                Some(g) => vector::gelu_backward(self.form, x, g, y),
            };
        }
        for (i, y) in y.iter_mut().enumerate() {
            let (value, slope) = self.eval(wide(x[i]));
            *y = match g {
                Some(g) => elem(wide(g[i]) * slope),
                None => elem(value),
            };
        }
    }
}

impl FusedOp for GeluOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        let [(s, l)] = exactly(inputs)?;
        let y = per_float!(s, "gelu", self.map(&slice(s, l)?, None));
        Ok((y, l.shape().clone()))
    }

    fn bwd(&self, inputs: &[&Tensor], _y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [x] = exactly(inputs)?;
        let g = g.contiguous()?;
        let dx = per_dtype!(x.dtype(), T => {
            let dx = with_slice::<T, _>(x, |xs| with_slice(&g, |gs| Ok(self.map(xs, Some(gs)))))?;
            shaped(dx, x)?
        });
        Ok(vec![Some(dx)])
    }
}

custom_op!(GeluOp: 1 "fused-gelu");
