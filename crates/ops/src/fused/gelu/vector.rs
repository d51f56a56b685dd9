//! GELU and its gradient of f32 elements, many at once: libm's scalar f64 `erf` and `exp`, called
//! once per element, took 416 ms of CPU time a BERT-Large LoRA step on a 2-CPU Xeon (a ninth of
//! the step's). Not here: f64, which keeps the scalar formulas (`GeluOp::eval`), and the op around
//! them (`gelu`).
//!
//! Each formula uses fused multiply-adds, exact operations and `exp1` only, compiled by
//! `vectorised!`: the same bits on every processor, as `exp`.
//!
//! - Exact (erf): cdf(x) = (1 + erf(z)) / 2, z = x / sqrt 2, by Norbert Juffa's `erff` (published
//!   on Stack Overflow, question 35148198; MLX's and PyTorch's Metal `erf`): below |z| = 0.9277
//!   erf(z) = z + z p(z^2), above it erf(|z|) = 1 - exp(q(|z|)), each within 1 ulp. Above, exp(q)
//!   is erfc(|z|) and the cdf of a negative x is exp(q) / 2, not a difference of near-equal
//!   numbers.
//! - tanh: (1 + tanh u) / 2 = sigmoid(2u) = 1 / (1 + exp(-2u)), and 1 - sigmoid(2u) =
//!   exp(-2u) sigmoid(2u): no tanh, nothing subtracted where it would cancel.
//!
//! Within 3 ulp of gelu(x) and gelu'(x) computed in f64 (the exact form within 2), and 1e-7 |x|
//! more where the cdf is below a half, where the error of exp in sigmoid(2u) or in erfc is that
//! much of the value's scale (the tests). An infinite x gives NaN where the exact formula has
//! inf x 0 (gelu(-inf), gelu'(+-inf)), as PyTorch's.

use super::GeluForm;
use crate::fused::exp::exp1;

const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// 1 / sqrt(2 pi): the normal density's factor.
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;
/// sqrt(2 / pi) and 0.044715: the tanh form's u = sqrt(2 / pi) (x + 0.044715 x^3).
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const KAPPA: f32 = 0.044_715;

/// The standard normal's cdf, (1 + erf(x / sqrt 2)) / 2.
#[inline(always)]
fn cdf(x: f32) -> f32 {
    let z = x * FRAC_1_SQRT_2;
    let (t, s) = (z.abs(), z * z);
    // |z| <= 0.9277: erf(z) = z + z p(z^2).
    let p = (-5.967_617e-4_f32)
        .mul_add(s, 4.991_194_2e-3)
        .mul_add(s, -2.676_813_5e-2)
        .mul_add(s, 1.128_199_3e-1)
        .mul_add(s, -3.761_253_4e-1)
        .mul_add(s, 1.283_791_7e-1);
    let near = p.mul_add(z, z).mul_add(0.5, 0.5);
    // Above: erfc(t) = exp(q(t)), q(t) = -t + t (c1 + t (c2 + t (c3 + t (u + t^2 r)))).
    let r = (-1.728_534_7e-5_f32).mul_add(t, 3.831_971_3e-4);
    let u = (-3.883_964_4e-3_f32).mul_add(t, 2.425_462_2e-2);
    let q = r
        .mul_add(s, u)
        .mul_add(t, -1.067_778_8e-1)
        .mul_add(t, -6.348_467e-1)
        .mul_add(t, -1.287_175_1e-1)
        .mul_add(t, -t);
    let half_erfc = 0.5 * exp1(q);
    let far = if z > 0.0 { 1.0 - half_erfc } else { half_erfc };
    // A NaN compares false: it takes `near`, which keeps it.
    if t > 0.927_734_4 {
        far
    } else {
        near
    }
}

/// (sigmoid(2u), 1 - sigmoid(2u)) for the tanh form's u, each without cancellation.
#[inline(always)]
fn sigmoids(x: f32) -> (f32, f32) {
    let u = SQRT_2_OVER_PI * (KAPPA * x * x).mul_add(x, x);
    let e = exp1(-2.0 * u);
    let s = 1.0 / (1.0 + e);
    // 1 - s = e s; where e > 1, s < 1/2 and the difference loses nothing (and e may be inf).
    (s, if e <= 1.0 { e * s } else { 1.0 - s })
}

/// gelu'(x) of the exact form: cdf(x) + x pdf(x); where x^2 overflows, pdf is 0 and so is x pdf.
#[inline(always)]
fn erf_slope(x: f32) -> f32 {
    erf_slope_of(x, cdf(x))
}

/// [`erf_slope`] of x with its cdf `c`.
#[inline(always)]
fn erf_slope_of(x: f32, c: f32) -> f32 {
    x.mul_add(exp1(-0.5 * (x * x)) * FRAC_1_SQRT_2PI, c)
}

/// gelu'(x) of the tanh form: s + 2 x s (1 - s) u'(x), s = sigmoid(2u).
#[inline(always)]
fn tanh_slope(x: f32) -> f32 {
    tanh_slope_of(x, sigmoids(x))
}

/// [`tanh_slope`] of x with its [`sigmoids`].
#[inline(always)]
fn tanh_slope_of(x: f32, (s, rest): (f32, f32)) -> f32 {
    // s (1 - s) is 0 in f32 beyond |x| = 11; the bound keeps x^2 finite in u'(x).
    let xc = x.clamp(-100.0, 100.0);
    let du = SQRT_2_OVER_PI * (3.0 * KAPPA * xc).mul_add(xc, 1.0);
    // x before the clamp: an infinite x times s (1 - s) = 0 is NaN, as the exact formula's.
    (2.0 * x * (s * rest)).mul_add(du, s)
}

vectorised! {
    /// gelu(x) in the form `form`, element by element, into `y`.
    pub(super) fn gelu(form: GeluForm, x: &[f32], y: &mut [f32]) {
        match form {
            GeluForm::Erf => y.iter_mut().zip(x).for_each(|(y, &x)| *y = x * cdf(x)),
            GeluForm::Tanh => y.iter_mut().zip(x).for_each(|(y, &x)| *y = x * sigmoids(x).0),
        }
    }
}

vectorised! {
    /// gelu(x) into `y` and g gelu'(x) over g, element by element, in one pass: the cdf (or the
    /// sigmoid) made once for both, as a layer that makes the GELU again in backward needs them.
    /// The same bits as [`gelu`] and [`gelu_backward`].
    pub(super) fn gelu_and_backward(form: GeluForm, x: &[f32], g: &mut [f32], y: &mut [f32]) {
        let out = y.iter_mut().zip(g.iter_mut());
        match form {
            GeluForm::Erf => out.zip(x).for_each(|((y, g), &x)| {
                let c = cdf(x);
                (*y, *g) = (x * c, *g * erf_slope_of(x, c));
            }),
            GeluForm::Tanh => out.zip(x).for_each(|((y, g), &x)| {
                let s = sigmoids(x);
                (*y, *g) = (x * s.0, *g * tanh_slope_of(x, s));
            }),
        }
    }
}

vectorised! {
    /// g gelu'(x) in the form `form`, element by element, into `y`.
    pub(super) fn gelu_backward(form: GeluForm, x: &[f32], g: &[f32], y: &mut [f32]) {
        let xg = x.iter().zip(g);
        match form {
            GeluForm::Erf => y.iter_mut().zip(xg).for_each(|(y, (&x, &g))| *y = g * erf_slope(x)),
            GeluForm::Tanh => {
                y.iter_mut().zip(xg).for_each(|(y, (&x, &g))| *y = g * tanh_slope(x))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::GeluOp;
    use super::*;

    fn both(form: GeluForm, xs: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let (mut y, mut dy) = (vec![0.0; xs.len()], vec![0.0; xs.len()]);
        gelu(form, xs, &mut y);
        gelu_backward(form, xs, &vec![1.0; xs.len()], &mut dy);
        (y, dy)
    }

    /// Within 3 ulp of the f64 value (the exact form within 2), and 1e-7 |x| more where the cdf
    /// is below a half, over [-12, 12] (on this machine's widest path; every path gives the same
    /// bits).
    #[test]
    fn gelu_and_its_gradient_are_within_three_ulp_of_f64() {
        let xs: Vec<f32> = (0..=480_000).map(|i| -12.0 + i as f32 * 5e-5).collect();
        for form in [GeluForm::Erf, GeluForm::Tanh] {
            let (y, dy) = both(form, &xs);
            for ((&x, &y), &dy) in xs.iter().zip(&y).zip(&dy) {
                // The f64 kernel's formulas.
                let (value, slope) = GeluOp { form }.eval(x as f64);
                for (what, got, want) in [("gelu", y, value), ("gelu'", dy, slope)] {
                    let ulp = ((want as f32).abs().next_up() - (want as f32).abs()) as f64;
                    let ulps = if form == GeluForm::Erf { 2.0 } else { 3.0 };
                    let tail = if x < 0.0 { 1e-7 * x.abs() as f64 } else { 0.0 };
                    let err = (got as f64 - want).abs();
                    assert!(
                        err <= ulps * ulp + tail,
                        "{form:?} {what}({x}) = {got}, in f64 {want}: off by {err:e}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_edges_are_the_exact_formulas() {
        let xs = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30, -1e30, 0.0];
        for form in [GeluForm::Erf, GeluForm::Tanh] {
            let (y, dy) = both(form, &xs);
            assert!(y[0].is_nan() && dy[0].is_nan(), "{form:?}: NaN");
            assert_eq!(y[1], f32::INFINITY, "{form:?}: gelu(inf)");
            assert!(dy[1].is_nan() && y[2].is_nan() && dy[2].is_nan(), "{form:?}: inf x 0");
            assert_eq!((y[3], dy[3]), (1e30, 1.0), "{form:?}: a large x");
            assert_eq!((y[4], dy[4]), (0.0, 0.0), "{form:?}: a large negative x");
            assert_eq!((y[5], dy[5]), (0.0, 0.5), "{form:?}: 0");
        }
    }

    /// The vector paths and the scalar formulas give the same bits (the odd length leaves a tail),
    /// and so does the pass that makes both.
    #[test]
    fn every_path_gives_the_same_bits() {
        let xs: Vec<f32> = (0..1001).map(|i| (i as f32 * 0.377).sin() * 9.0).collect();
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for form in [GeluForm::Erf, GeluForm::Tanh] {
            let (y, dy) = both(form, &xs);
            let scalar: Vec<f32> = match form {
                GeluForm::Erf => xs.iter().map(|&x| x * cdf(x)).collect(),
                GeluForm::Tanh => xs.iter().map(|&x| x * sigmoids(x).0).collect(),
            };
            let scalar_dy: Vec<f32> = match form {
                GeluForm::Erf => xs.iter().map(|&x| erf_slope(x)).collect(),
                GeluForm::Tanh => xs.iter().map(|&x| tanh_slope(x)).collect(),
            };
            assert_eq!(bits(&y), bits(&scalar), "{form:?}: gelu");
            assert_eq!(bits(&dy), bits(&scalar_dy), "{form:?}: gelu'");
            // Both in one pass: the same bits.
            let (mut y1, mut dy1) = (vec![0.0; xs.len()], vec![1.0; xs.len()]);
            gelu_and_backward(form, &xs, &mut dy1, &mut y1);
            assert_eq!((bits(&y1), bits(&dy1)), (bits(&y), bits(&dy)), "{form:?}: one pass");
        }
    }
}
