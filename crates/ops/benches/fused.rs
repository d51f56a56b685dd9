//! Each fused op of `ops::fused`, forward and backward, against the same op composed from
//! candle's elementwise ops, at the shapes the `cpu` profile's models run them:
//! `cargo bench -p ops --bench fused`. `scripts/torch_ops.py` times PyTorch's convolutions at
//! the same shapes.

use candle_core::{DType, Device, Result, Tensor, Var, D};
use criterion::{criterion_group, criterion_main, Criterion};
use ops::fused::{self, Mask};
use ops::WeightLayout;
use remat::rng::RngKey;

fn var(name: &str, shape: &[usize]) -> Var {
    let v = RngKey::named(1, name).normal(shape.iter().product(), 0.0, 1.0);
    Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu).unwrap()).unwrap()
}

/// One forward and backward of `f` (a sum of its output as the loss).
fn step(f: &dyn Fn() -> Result<Tensor>) {
    let y = f().unwrap();
    let loss = if y.rank() == 0 { y } else { y.sum_all().unwrap() };
    std::hint::black_box(loss.backward().unwrap());
}

fn batch_norm_relu_composed(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let mean = x.mean_keepdim(vec![0, 2, 3])?;
    let centred = x.broadcast_sub(&mean)?;
    let var = centred.sqr()?.mean_keepdim(vec![0, 2, 3])?;
    let x_hat = x.broadcast_sub(&mean)?.broadcast_div(&(var + 1e-5)?.sqrt()?)?;
    x_hat
        .broadcast_mul(&w.reshape((1, (), 1, 1))?)?
        .broadcast_add(&b.reshape((1, (), 1, 1))?)?
        .relu()
}

fn bench(c: &mut Criterion) {
    // GPT-2 small, batch 2, seq 256: LayerNorm and dropout on (B, T, C), attention maps.
    let x = var("x", &[2, 256, 768]);
    let (w, b) = (var("w", &[768]), var("b", &[768]));
    let scores = var("scores", &[2, 12, 256, 256]);
    let logits = var("logits", &[512, 50257]);
    let targets =
        Tensor::from_vec((0..512u32).map(|i| (i * 97) % 50257).collect(), 512, &Device::Cpu)
            .unwrap();
    // ResNet-50 at 128x128, batch 8: the stem's BatchNorm + ReLU.
    let feat = var("feat", &[8, 64, 64, 64]);
    let (fw, fb) = (var("fw", &[64]), var("fb", &[64]));
    let mut params = params::ParamStore::new(&Device::Cpu, DType::F32, 0);
    let bn = ops::BatchNorm::new(&mut params, "bn", 64).unwrap();
    let recompute = remat::StageCtx::new(remat::RunPoint {
        recompute: true,
        train: true,
        ..Default::default()
    }); // training; statistics stay put
    let key = RngKey::named(2, "dropout");
    let causal = Tensor::from_vec(
        (0..256 * 256).map(|i| u8::from(i % 256 > i / 256)).collect(),
        (256, 256),
        &Device::Cpu,
    )
    .unwrap();
    let neg_inf =
        Tensor::new(f32::NEG_INFINITY, &Device::Cpu).unwrap().broadcast_as(scores.shape()).unwrap();

    // BERT-Large, batch 2, seq 128: the intermediate dense layer, weight stored (out, in).
    let h = var("h", &[2, 128, 1024]);
    let (wi, bi) = (var("wi", &[4096, 1024]), var("bi", &[4096]));

    // GPT-2 small attention heads: q, k, v (2, 12, 256, 64).
    let (q, k, v) =
        (var("q", &[2, 12, 256, 64]), var("k", &[2, 12, 256, 64]), var("v", &[2, 12, 256, 64]));

    // ResNet-50 at 128x128, batch 8: the stem, a 3x3 and a 1x1 convolution of the first stage.
    let (img, stem_w) = (var("img", &[8, 3, 128, 128]), var("stem_w", &[64, 3, 7, 7]));
    let (a64, w3) = (var("a64", &[8, 64, 32, 32]), var("w3", &[64, 64, 3, 3]));
    let (a256, w1) = (var("a256", &[8, 256, 32, 32]), var("w1", &[64, 256, 1, 1]));
    // ... and a 3x3 convolution of the last stage (4x4 feature maps, 512 channels).
    let (a512, w512) = (var("a512", &[8, 512, 4, 4]), var("w512", &[512, 512, 3, 3]));
    // GPT-2 small's token embedding at batch 2, seq 256.
    let wte = var("wte", &[50257, 768]);
    let ids =
        Tensor::from_vec((0..512u32).map(|i| (i * 7919) % 50257).collect(), (2, 256), &Device::Cpu)
            .unwrap();
    // The small 3D U-Net at 32^3, batch 2: the last up-convolution (64 -> 64 channels, 16^3 ->
    // 32^3).
    let (low, wup, bup) =
        (var("low", &[2, 64, 16, 16, 16]), var("wup", &[64, 64, 2, 2, 2]), var("bup", &[64]));
    // The small 3D U-Net at 32^3, batch 2: a 3x3x3 convolution of the first level.
    let (vol, w333) = (var("vol", &[2, 32, 32, 32, 32]), var("w333", &[32, 32, 3, 3, 3]));

    type Op<'a> = Box<dyn Fn() -> Result<Tensor> + 'a>;
    let cases: Vec<(&str, Op, Op)> = vec![
        (
            "layer_norm (2, 256, 768)",
            Box::new(|| fused::layer_norm(&x, &w, &b, 1e-5)),
            Box::new(|| candle_nn::ops::layer_norm_slow(&x, &w, &b, 1e-5)),
        ),
        (
            "linear (2, 128, 1024) -> 4096",
            Box::new(|| fused::linear(&h, &wi, Some(&bi), WeightLayout::OutIn)),
            Box::new(|| {
                h.as_tensor()
                    .reshape((256, 1024))?
                    .matmul(&wi.as_tensor().t()?)?
                    .broadcast_add(&bi)?
                    .reshape((2, 128, 4096))
            }),
        ),
        (
            "causal softmax (2, 12, 256, 256)",
            Box::new(|| fused::softmax_last_dim(&scores, 0.125, Mask::Causal)),
            Box::new(|| {
                let s = (scores.as_tensor() * 0.125)?;
                candle_nn::ops::softmax(
                    &causal.broadcast_as(s.shape())?.where_cond(&neg_inf, &s)?,
                    D::Minus1,
                )
            }),
        ),
        (
            "causal attention with dropout (2, 12, 256, 64)",
            Box::new(|| fused::attention(&q, &k, &v, 0.125, Mask::Causal, None, Some((key, 0.1)))),
            Box::new(|| {
                let s = (q.matmul(&k.t()?)? * 0.125)?;
                let p = candle_nn::ops::softmax(
                    &causal.broadcast_as(s.shape())?.where_cond(&neg_inf, &s)?,
                    D::Minus1,
                )?;
                (p * Tensor::from_vec(
                    key.dropout_mask(2 * 12 * 256 * 256, 0.1),
                    (2, 12, 256, 256),
                    &Device::Cpu,
                )?)?
                .matmul(&v)
            }),
        ),
        (
            "cross_entropy (512, 50257)",
            Box::new(|| fused::cross_entropy(&logits, &targets, None)),
            Box::new(|| candle_nn::loss::cross_entropy(&logits, &targets)),
        ),
        (
            "batch_norm + relu (8, 64, 64, 64)",
            Box::new(|| bn.forward_relu(&feat, &recompute)),
            Box::new(|| batch_norm_relu_composed(&feat, &fw, &fb)),
        ),
        (
            "dropout (2, 256, 768)",
            Box::new(|| fused::dropout(&x, key, 0.1)),
            // The composed dropout: draw the mask, hold it, multiply.
            Box::new(|| {
                x.as_tensor()
                    * Tensor::from_vec(
                        key.dropout_mask(x.elem_count(), 0.1),
                        x.shape(),
                        &Device::Cpu,
                    )?
            }),
        ),
        (
            "conv2d 7x7/2 (8, 3, 128, 128) -> 64",
            Box::new(|| ops::conv2d(&img, &stem_w, 3, 2)),
            Box::new(|| img.conv2d(&stem_w, 3, 2, 1, 1)),
        ),
        (
            "conv2d 3x3 (8, 64, 32, 32) -> 64",
            Box::new(|| ops::conv2d(&a64, &w3, 1, 1)),
            Box::new(|| a64.conv2d(&w3, 1, 1, 1, 1)),
        ),
        (
            "conv2d 3x3 (8, 512, 4, 4) -> 512",
            Box::new(|| ops::conv2d(&a512, &w512, 1, 1)),
            Box::new(|| a512.conv2d(&w512, 1, 1, 1, 1)),
        ),
        (
            "conv2d 1x1 (8, 256, 32, 32) -> 64",
            Box::new(|| ops::conv2d(&a256, &w1, 0, 1)),
            Box::new(|| a256.conv2d(&w1, 0, 1, 1, 1)),
        ),
        (
            "max_pool 3x3/2 (8, 64, 64, 64)",
            Box::new(|| ops::max_pool2d_k3s2p1(&feat)),
            // The composed stem pool: separable, rows then columns.
            Box::new(|| {
                let pool = |x: &Tensor, axis: usize| -> Result<Tensor> {
                    let pad = |len: usize| {
                        let mut shape = x.dims().to_vec();
                        shape[axis] = len;
                        Tensor::full(f32::NEG_INFINITY, shape, &Device::Cpu)
                    };
                    let padded = Tensor::cat(&[&pad(1)?, x, &pad(1)?], axis)?;
                    let mut shape = x.dims().to_vec();
                    shape[axis] = 32;
                    shape.insert(axis + 1, 2);
                    let first_two =
                        padded.narrow(axis, 0, 64)?.reshape(shape.clone())?.max(axis + 1)?;
                    first_two.maximum(
                        &padded
                            .narrow(axis, 2, 64)?
                            .reshape(shape)?
                            .narrow(axis + 1, 0, 1)?
                            .squeeze(axis + 1)?,
                    )
                };
                pool(&pool(&feat, 2)?, 3)
            }),
        ),
        (
            "embedding (2, 256) of (50257, 768)",
            Box::new(|| fused::embedding(&wte, &ids)),
            Box::new(|| wte.index_select(&ids.flatten_all()?, 0)?.reshape((2, 256, 768))),
        ),
        (
            "conv_transpose3d 2x2x2/2 (2, 64, 16, 16, 16) -> 64",
            Box::new(|| ops::conv_transpose3d_k2s2(&low, &wup, &bup)),
            Box::new(|| {
                let cols = low.permute((0, 2, 3, 4, 1))?.reshape((2 * 4096, 64))?;
                let y = cols
                    .matmul(&wup.reshape((64, 512))?)?
                    .reshape(vec![2, 16, 16, 16, 64, 2, 2, 2])?;
                y.permute([0, 4, 1, 5, 2, 6, 3, 7])?
                    .reshape((2, 64, 32, 32, 32))?
                    .broadcast_add(&bup.reshape((1, 64, 1, 1, 1))?)
            }),
        ),
        (
            "conv3d 3x3x3 (2, 32, 32, 32, 32) -> 32",
            Box::new(|| ops::conv3d(&vol, &w333, ops::Conv3dGeometry::same(3))),
            // The composed version: a 2D convolution per kernel depth over gathered slices.
            Box::new(|| {
                let x = vol.pad_with_zeros(2, 1, 1)?;
                let mut sum: Option<Tensor> = None;
                for a in 0..3 {
                    let idx = Tensor::arange(a as u32, a as u32 + 32, &Device::Cpu)?;
                    let slices = x
                        .index_select(&idx, 2)?
                        .permute((0, 2, 1, 3, 4))?
                        .reshape((64, 32, 32, 32))?;
                    let y = slices.conv2d(&w333.narrow(2, a, 1)?.squeeze(2)?, 1, 1, 1, 1)?;
                    sum = Some(match sum {
                        Some(s) => (s + y)?,
                        None => y,
                    });
                }
                sum.expect("three slices")
                    .reshape((2, 32, 32, 32, 32))?
                    .permute((0, 2, 1, 3, 4))?
                    .contiguous()
            }),
        ),
    ];
    for (name, fused_op, composed) in &cases {
        let mut g = c.benchmark_group(*name);
        g.sample_size(10);
        g.bench_function("fused", |bch| bch.iter(|| step(fused_op)));
        g.bench_function("composed", |bch| bch.iter(|| step(composed)));
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
