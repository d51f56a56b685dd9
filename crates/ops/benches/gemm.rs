//! The matrix product the fused kernels run (gemm, as `ops::fused` calls it, split over
//! candle's threads) at the shapes the `cpu` profile's models give it, in GFLOP/s (criterion's
//! "elements" per second are FLOPs), with each operand stored row-major or column-major: the
//! layout decides whether gemm packs an operand, and at these shapes that is worth up to 3x.
//! `cargo bench -p layers --bench gemm`; `scripts/torch_ops.py` times `torch.mm` at the same
//! shapes and threads.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};

/// (what, m, k, n): `(m, k) @ (k, n)`.
const SHAPES: [(&str, usize, usize, usize); 18] = [
    ("resnet50 3x3 stage 1, 3 images", 64, 576, 3072),
    ("resnet50 3x3 stage 1, 3 images, pixels first", 3072, 576, 64),
    ("resnet50 1x1 256->64, 1 image", 64, 256, 1024),
    ("resnet50 1x1 256->64, 1 image, pixels first", 1024, 256, 64),
    ("resnet50 1x1 256->64 weight gradient, 1 image", 64, 1024, 256),
    ("resnet50 1x1 256->64 weight gradient transposed, 1 image", 256, 1024, 64),
    ("resnet50 1x1 256->64 input gradient, 1 image", 256, 64, 1024),
    ("resnet50 3x3 stage 4, 8 images", 512, 4608, 128),
    ("unet3d 3x3x3 32->32, 2 slices", 32, 864, 2048),
    ("unet3d 3x3x3 32->32, 2 slices, voxels first", 2048, 864, 32),
    ("unet3d 3x3x3 32->32 weight gradient", 32, 2048, 864),
    ("gpt2 qkv, 2 x 256 tokens", 512, 768, 2304),
    ("bert-large intermediate, 2 x 128 tokens", 256, 1024, 4096),
    ("smollm2 q and o, 2 x 512 tokens", 1024, 576, 576),
    ("smollm2 gate and up, 2 x 512 tokens", 1024, 576, 1536),
    ("smollm2 down, 2 x 512 tokens", 1024, 1536, 576),
    ("smollm2 down weight gradient", 576, 1024, 1536),
    ("smollm2 head, 2 x 512 tokens", 1024, 576, 49152),
];

/// (row stride, column stride) of a (rows, cols) matrix stored row-major or column-major.
fn strides(column_major: bool, rows: usize, cols: usize) -> (isize, isize) {
    if column_major {
        (1, rows as isize)
    } else {
        (cols as isize, 1)
    }
}

/// `dst (m, n) = a (m, k) @ b (k, n)`, `dst` row-major, `a` and `b` as `layout` says.
fn product(
    dst: &mut [f32],
    a: &[f32],
    b: &[f32],
    (m, k, n): (usize, usize, usize),
    layout: (bool, bool),
    threads: usize,
) {
    let parallelism =
        if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    let ((a_rs, a_cs), (b_rs, b_cs)) = (strides(layout.0, m, k), strides(layout.1, k, n));
    // SAFETY: the slices hold (m, k), (k, n) and (m, n) matrices with these strides.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

fn bench(c: &mut Criterion) {
    let threads = candle_core::utils::get_num_threads();
    let name = |column_major: bool| if column_major { "column-major" } else { "row-major" };
    for (what, m, k, n) in SHAPES {
        let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 * 0.1).collect();
        let mut dst = vec![0f32; m * n];
        let mut g =
            c.benchmark_group(format!("gemm {what} ({m}, {k}) @ ({k}, {n}), {threads} threads"));
        g.throughput(Throughput::Elements((2 * m * k * n) as u64));
        g.sample_size(10);
        for layout in [(false, false), (true, false), (false, true), (true, true)] {
            g.bench_function(format!("a {}, b {}", name(layout.0), name(layout.1)), |bch| {
                bch.iter(|| product(&mut dst, &a, &b, (m, k, n), layout, threads))
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
