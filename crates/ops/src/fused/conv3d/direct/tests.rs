//! The direct kernels against the matrix products and the weight gradient's definition, on each
//! instruction set this processor has, and at several thread counts. Not here: the convolution's
//! tests through the crate's layers (`layers::convolution`, `tests/`).

use super::forward::{convolve, tile_fn};
use super::plan::{Isa, Plan, WeightPlan};
use super::weight_gradient::{grad_fn, weight_gradient};
use crate::fused::conv3d::input::Input;
use crate::fused::conv3d::shape::{Conv3dGeometry, Conv3dShape};
use crate::fused::conv3d::Kernel;

fn rand(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{what}: element {i}: {g} vs {w}");
    }
}

type Dims = (usize, usize, usize, usize, usize);

/// Shapes that take each kind of tile: output channels that do not fill a vector, rows that
/// are not made of fours or eights, strides of 2, kernels 1, 3 and 7 wide, 2D and 3D.
fn cases() -> Vec<(Dims, Dims, Conv3dGeometry)> {
    let strided = |pad| Conv3dGeometry { stride_d: 1, stride_hw: 2, pad_d: 0, pad_hw: pad };
    vec![
        ((2, 5, 5, 6, 7), (6, 5, 3, 3, 3), Conv3dGeometry::same(3)),
        ((2, 16, 4, 8, 8), (32, 16, 3, 3, 3), Conv3dGeometry::same(3)),
        ((3, 4, 1, 9, 9), (40, 4, 1, 3, 3), strided(1)),
        ((2, 3, 1, 15, 15), (64, 3, 1, 7, 7), strided(3)),
        ((2, 8, 4, 10, 10), (32, 8, 3, 1, 1), Conv3dGeometry { pad_d: 1, ..strided(0) }),
        ((1, 3, 6, 5, 4), (16, 3, 3, 3, 3), Conv3dGeometry { stride_d: 2, ..strided(1) }),
    ]
}

/// The weight gradient by its definition.
fn weight_gradient_naive(s: &Conv3dShape, x: &[f32], gy: &[f32]) -> Vec<f32> {
    let ([kd, kh, kw], [od, oh, ow], [d, h, w]) = (s.kernel, s.output, s.input);
    let mut dw = vec![0f32; s.o * s.c * kd * kh * kw];
    for (n, o, c) in
        (0..s.n).flat_map(|n| (0..s.o).flat_map(move |o| (0..s.c).map(move |c| (n, o, c))))
    {
        for (a, b, k) in
            (0..kd).flat_map(|a| (0..kh).flat_map(move |b| (0..kw).map(move |k| (a, b, k))))
        {
            let mut sum = 0f32;
            for (z, y, xx) in
                (0..od).flat_map(|z| (0..oh).flat_map(move |y| (0..ow).map(move |xx| (z, y, xx))))
            {
                let (Some(zz), Some(yy), Some(xi)) =
                    (s.source(0, z, a), s.source(1, y, b), s.source(2, xx, k))
                else {
                    continue;
                };
                sum += gy[((n * s.o + o) * od + z) * oh * ow + y * ow + xx]
                    * x[(((n * s.c + c) * d + zz) * h + yy) * w + xi];
            }
            dw[((o * s.c + c) * kd + a) * kh * kw + b * kw + k] += sum;
        }
    }
    dw
}

/// Every tile and weight-gradient kernel the plans can choose exists, on each instruction
/// set this processor has.
#[test]
fn every_plan_has_its_kernels() {
    for isa in Isa::available() {
        for (o, ow, kw, sx) in (1..=70).flat_map(|o| {
            [1, 4, 7, 8, 16].into_iter().flat_map(move |ow| {
                [1, 2, 3, 5, 7].into_iter().flat_map(move |kw| [1, 2].map(|sx| (o, ow, kw, sx)))
            })
        }) {
            let pad = kw / 2;
            let x = (1, 5, 1, 9, (ow - 1) * sx + kw - 2 * pad);
            let g = Conv3dGeometry { stride_d: 1, stride_hw: sx, pad_d: 0, pad_hw: pad };
            let s = Conv3dShape::new(x, (o, 5, 1, kw, kw), g, 1 << 20).unwrap();
            if let Some(plan) = Plan::for_isa(&s, isa) {
                (1..=plan.rows).for_each(|r| {
                    let _ = tile_fn(plan, r, sx);
                });
            }
            if let Some(plan) = WeightPlan::for_isa(&s, isa) {
                (1..=plan.groups).for_each(|g| {
                    let _ = grad_fn(plan, kw, g, sx);
                });
            }
        }
    }
}

/// The direct kernels give the matrix products' convolution, the input gradient's (the
/// flipped kernel) and the weight gradient's definition, on each instruction set this
/// processor has, with slabs of one depth plane, of several samples, and an input in two
/// tensors written into two outputs.
#[test]
fn direct_convolutions_agree_with_the_matrix_products() {
    for isa in Isa::available() {
        for (case, &(xd, wd, g)) in cases().iter().enumerate() {
            for entries in [1, 1 << 16] {
                let s = Conv3dShape::new(xd, wd, g, entries).unwrap();
                let what = format!("{isa:?} {xd:?} {wd:?} {g:?} blocks of {entries}");
                let x = rand(s.n * s.c * s.volume(), case as u64);
                let w = rand(s.o * s.rows(), 100 + case as u64);
                let gy = rand(s.n * s.o * s.cols(), 200 + case as u64);
                let split = s.c / 2;
                let (first, second): (Vec<f32>, Vec<f32>) = {
                    let per = s.c * s.volume();
                    let parts = x.chunks(per).map(|x_n| x_n.split_at(split * s.volume()));
                    let (a, b): (Vec<_>, Vec<_>) = parts.unzip();
                    (a.concat(), b.concat())
                };
                let two = Input { first: &first, second: &second, split };
                let whole = Input::whole(&x, s.c);
                let plan = Plan::for_isa(&s, isa).unwrap();
                let parts = [0..s.o.min(3), s.o.min(3)..s.o];
                let want = s.convolve(whole, &w, Kernel::AsIs, &[s.o.min(3), s.o - s.o.min(3)]);
                for input in [whole, two] {
                    let got = convolve(&s, plan, input, &w, Kernel::AsIs, &parts);
                    close(&got.concat(), &want.concat(), &format!("forward, {what}"));
                }
                if s.unit_stride() {
                    let t = s.transposed();
                    let plan = Plan::for_isa(&t, isa).unwrap();
                    let gy_in = Input::whole(&gy, s.o);
                    let got =
                        convolve(&t, plan, gy_in, &w, Kernel::Flipped, &t.part_ranges(&[s.c]));
                    let want = t.convolve(gy_in, &w, Kernel::Flipped, &[s.c]);
                    close(&got[0], &want[0], &format!("input gradient, {what}"));
                }
                let plan = WeightPlan::for_isa(&s, isa).unwrap();
                let want = weight_gradient_naive(&s, &x, &gy);
                for input in [whole, two] {
                    let got = weight_gradient(&s, plan, input, &gy);
                    close(&got, &want, &format!("weight gradient, {what}"));
                }
            }
        }
    }
}

/// The same bits with 1, 2 or 7 threads.
#[test]
fn direct_convolutions_do_not_depend_on_the_threads() {
    let (xd, wd, g) = cases()[1];
    let s = Conv3dShape::new(xd, wd, g, 1 << 14).unwrap();
    let (x, w, gy) =
        (rand(s.n * s.c * s.volume(), 1), rand(s.o * s.rows(), 2), rand(s.n * s.o * s.cols(), 3));
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let input = Input::whole(&x, s.c);
            let y = convolve(
                &s,
                Plan::of(&s).unwrap(),
                input,
                &w,
                Kernel::AsIs,
                &s.part_ranges(&[s.o]),
            );
            let dw = weight_gradient(&s, WeightPlan::of(&s).unwrap(), input, &gy);
            [y.concat(), dw].map(|v| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>())
        })
    };
    if Isa::detect().is_some() {
        let one = run(1);
        assert_eq!(one, run(2));
        assert_eq!(one, run(7));
    }
}
