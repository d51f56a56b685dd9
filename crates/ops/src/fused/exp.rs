//! `exp` of f32 elements in place, many at once: the softmaxes (attention, cross-entropy) spend
//! most of their time in it, and libm's `expf`, called once per element, took a seventh of a
//! SmolLM2-135M step's CPU time where PyTorch's vectorised exp takes a hundredth. Not here: f64,
//! which stays with the scalar `exp` (`Elem::exp_in_place`).
//!
//! One formula, Cephes' `expf` (a degree-5 polynomial of the remainder after taking out whole
//! powers of two, within 2 ulp of the exact value), written with fused multiply-adds only and
//! compiled by `vectorised!`, so that every path (AVX-512, AVX2 + FMA, or any other processor,
//! where `mul_add` is a library call) gives the same bits: the same inputs give the same outputs
//! on any machine. GELU's f32 formulas (`gelu::vector`) call it too. Below
//! ln(f32::MIN_POSITIVE) the result is 0 (libm's would be subnormal, under 1.2e-38), so a masked
//! -inf entry becomes an exact 0; above ln(f32::MAX) it is +inf; NaN stays NaN.

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 in two parts, the first exact in few bits, so `x - n ln 2` loses nothing.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// ln(f32::MAX) and ln(f32::MIN_POSITIVE): beyond them the result is +inf, or 0.
const MAX_ARG: f32 = 88.722_84;
const MIN_ARG: f32 = -87.336_55;

/// exp(x) by the formula above, for one element: inlined into the loops that call it, which
/// `vectorised!` compiles for the processor's vectors.
#[inline(always)]
pub(crate) fn exp1(x: f32) -> f32 {
    let c = x.clamp(MIN_ARG, MAX_ARG);
    // x = n ln 2 + r, |r| <= ln 2 / 2.
    let n = c.mul_add(LOG2E, 0.5).floor();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, c));
    let p = 1.987_569_2e-4_f32
        .mul_add(r, 1.398_199_9e-3)
        .mul_add(r, 8.333_452e-3)
        .mul_add(r, 4.166_579_6e-2)
        .mul_add(r, 1.666_666_5e-1)
        .mul_add(r, 0.5);
    let e = (r * r).mul_add(p, r) + 1.0;
    // 2^n, n in [-126, 128]: 128 (only at MAX_ARG's rounding) is taken as 2 * 2^127. n as an
    // integer read from the bits of n + 1.5 * 2^23 (a whole number below 2^22 lands in the low
    // bits): `as i32` saturates, which the compiler does one element at a time.
    let n = (n + 12_582_912.0).to_bits() as i32 - 0x4B40_0000;
    let (n, twice) = if n > 127 { (127, 2.0) } else { (n, 1.0) };
    let y = e * f32::from_bits(((n + 127) as u32) << 23) * twice;
    if x.is_nan() {
        x
    } else if x > MAX_ARG {
        f32::INFINITY
    } else if x < MIN_ARG {
        0.0
    } else {
        y
    }
}

vectorised! {
    /// Every element of `xs` replaced by its exp.
    pub(crate) fn exp_in_place(xs: &mut [f32]) {
        xs.iter_mut().for_each(|x| *x = exp1(*x));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Within 2 ulp of f64's exp over the range, on every path this machine has.
    #[test]
    fn exp_is_within_two_ulp_of_the_exact_value() {
        // Up to 88.7: at MAX_ARG itself the exact value rounds to +inf, as the formula gives.
        let xs: Vec<f32> =
            (0..=200_000).map(|i| MIN_ARG + (88.7 - MIN_ARG) * i as f32 / 2e5).collect();
        let mut ys = xs.clone();
        exp_in_place(&mut ys);
        for (&x, &y) in xs.iter().zip(&ys) {
            let exact = (x as f64).exp();
            let ulp = (exact as f32).next_up() as f64 - exact as f32 as f64;
            assert!((y as f64 - exact).abs() <= 2.0 * ulp, "exp({x}) = {y}, exactly {exact}");
        }
    }

    #[test]
    fn the_edges_are_zero_infinity_and_nan() {
        let mut v = [f32::NEG_INFINITY, -1e30, -88.0, 0.0, 89.0, f32::INFINITY, f32::NAN];
        exp_in_place(&mut v);
        assert_eq!(&v[..3], &[0.0, 0.0, 0.0]);
        assert_eq!(v[3], 1.0);
        assert_eq!(&v[4..6], &[f32::INFINITY, f32::INFINITY]);
        assert!(v[6].is_nan());
    }

    /// The vector paths and the scalar formula give the same bits (the odd length leaves a tail).
    #[test]
    fn every_path_gives_the_same_bits() {
        let xs: Vec<f32> = (0..1001).map(|i| (i as f32 * 0.377).sin() * 60.0).collect();
        let mut fast = xs.clone();
        exp_in_place(&mut fast);
        let scalar: Vec<f32> = xs.iter().map(|&x| exp1(x)).collect();
        assert_eq!(
            fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            scalar.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
}
