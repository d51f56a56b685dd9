//! The device-generic route of the fused ops (`ops::fused::Path::Generic`), forced on the CPU:
//! it gives the kernels' values and gradients, and keeps for backward what the kernels keep; the
//! same op composed in candle's graph keeps several tensors more (the control, which the kept-bytes
//! check must refuse). The path and the heap counter are process-wide: the tests take turns.

use candle_core::{DType, Device, Result, Tensor, Var, D};
use ops::fused::{set_path, Activation, GeluForm, LinearInput, Mask, Path};
use ops::WeightLayout;
use remat::memory::heap_current;
use remat::rng::RngKey;
use std::sync::atomic::{AtomicU64, Ordering};

#[global_allocator]
static ALLOC: remat::memory::CountingAlloc = remat::memory::CountingAlloc;

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// How many tensors the test holding the turn has drawn: the stream of its next one.
static DRAWN: AtomicU64 = AtomicU64::new(0);

/// Held for a whole test: another test's allocations, or its path, would enter the measurement.
/// Restarts the draws, so a test sees the same operands whatever ran before it.
fn turn() -> std::sync::MutexGuard<'static, ()> {
    let turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    DRAWN.store(0, Ordering::SeqCst);
    turn
}

/// Standard normal values, the same on every run: the paths reduce in different orders, so their
/// f32 sums differ by rounding, and fresh random operands made that rounding a draw too (a channel
/// whose gradient nearly cancels put one run in a few hundred past the tolerance).
fn normal(shape: &[usize]) -> Result<Tensor> {
    let key = RngKey::named(DRAWN.fetch_add(1, Ordering::SeqCst), "generic-route operand");
    Tensor::from_vec(key.normal(shape.iter().product(), 0.0, 1.0), shape, &Device::Cpu)
}

type Op = dyn Fn(&[Tensor]) -> Result<Tensor>;

/// The output and every operand's gradient of `op` on `path`, under the loss `sum(y * r)`.
fn values_and_grads(op: &Op, inputs: &[Var], r: &Tensor, path: Path) -> Result<Vec<Vec<f32>>> {
    set_path(path);
    let tensors: Vec<Tensor> = inputs.iter().map(|v| v.as_tensor().clone()).collect();
    let y = op(&tensors);
    set_path(Path::Kernel);
    let y = y?;
    let grads = (&y * r)?.sum_all()?.backward()?;
    let mut out = vec![y.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?];
    for v in inputs {
        out.push(
            grads
                .get(v.as_tensor())
                .expect("every operand has a gradient")
                .flatten_all()?
                .to_dtype(DType::F32)?
                .to_vec1()?,
        );
    }
    Ok(out)
}

/// Heap bytes the output of `op` holds alive between forward and backward, beyond its operands:
/// what dropping the output (and the graph it holds) frees. Read around the drop alone, so that
/// the pool threads' own allocations during the forward do not enter it.
fn kept_bytes(op: &Op, inputs: &[Var], path: Option<Path>) -> Result<u64> {
    let tensors: Vec<Tensor> = inputs.iter().map(|v| v.as_tensor().clone()).collect();
    if let Some(path) = path {
        set_path(path);
    }
    let y = op(&tensors);
    set_path(Path::Kernel);
    let y = y?;
    let with = heap_current();
    drop(y);
    Ok(with.saturating_sub(heap_current()))
}

/// The heap's peak above its level before, over `op`'s forward and backward on `path`: the output,
/// the gradients and every temporary inside the op (informational: the route's transient cost).
fn step_peak(op: &Op, inputs: &[Var], r: &Tensor, path: Path) -> Result<u64> {
    let tensors: Vec<Tensor> = inputs.iter().map(|v| v.as_tensor().clone()).collect();
    set_path(path);
    let (result, peak) = remat::memory::peak_during(|| -> Result<()> {
        let y = op(&tensors)?;
        (&y * r)?.sum_all()?.backward().map(drop)
    });
    set_path(Path::Kernel);
    result.map(|()| peak)
}

/// What the kept bytes of the two routes may differ by: the op's bookkeeping (tens of bytes) and
/// the pool threads' own allocations, which can still be alive when the heap is read (a few KiB).
/// The operands are sized so that what a composition would keep (a LayerNorm's centred input, a
/// score map, the logits, a product before its bias) is above it: 12-670 KiB.
const SLACK: u64 = 8 << 10;

/// Both paths on `inputs`: values and gradients within `tol` of the scale of each, and the same
/// bytes kept (within [`SLACK`]).
fn check(name: &str, op: &Op, inputs: &[Var], tol: f32) -> Result<u64> {
    let shape =
        op(&inputs.iter().map(|v| v.as_tensor().clone()).collect::<Vec<_>>())?.shape().clone();
    let r = normal(shape.dims())?.to_dtype(inputs[0].dtype())?;
    let kernel = values_and_grads(op, inputs, &r, Path::Kernel)?;
    let generic = values_and_grads(op, inputs, &r, Path::Generic)?;
    for (i, (k, g)) in kernel.iter().zip(&generic).enumerate() {
        let scale = k.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        let err = k.iter().zip(g).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
        let what = if i == 0 { "output".to_string() } else { format!("gradient {}", i - 1) };
        eprintln!("{name}: {what}: scaled error {err:.2e}");
        assert!(err <= tol, "{name}: {what} differs between the paths by {err:.2e} of its scale");
    }
    let (kernel, generic) =
        (kept_bytes(op, inputs, Some(Path::Kernel))?, kept_bytes(op, inputs, Some(Path::Generic))?);
    eprintln!("{name}: kept {kernel} B by the kernel, {generic} B by the generic route");
    let (kernel_peak, generic_peak) =
        (step_peak(op, inputs, &r, Path::Kernel)?, step_peak(op, inputs, &r, Path::Generic)?);
    eprintln!(
        "{name}: forward and backward peak {kernel_peak} B on the kernel, {generic_peak} B on the \
         generic route"
    );
    assert!(
        generic.abs_diff(kernel) <= SLACK,
        "{name}: the generic route keeps {generic} B, the kernel {kernel} B"
    );
    Ok(kernel)
}

fn var(shape: &[usize], dtype: DType) -> Result<Var> {
    Var::from_tensor(&normal(shape)?.to_dtype(dtype)?)
}

#[test]
fn layer_norm_on_the_generic_route() -> Result<()> {
    let _turn = turn();
    let op = |t: &[Tensor]| ops::fused::layer_norm(&t[0], &t[1], &t[2], 1e-5);
    let inputs = [var(&[8, 64, 64], DType::F32)?, var(&[64], DType::F32)?, var(&[64], DType::F32)?];
    let kernel = check("layer_norm f32", &op, &inputs, 1e-5)?;
    // The control: the composition left in the graph keeps its intermediates until backward.
    let composed = |t: &[Tensor]| candle_nn::ops::layer_norm_slow(&t[0], &t[1], &t[2], 1e-5);
    let in_graph = kept_bytes(&composed, &inputs, None)?;
    let x_bytes = 8 * 64 * 64 * 4;
    eprintln!("layer_norm composed in the graph: kept {in_graph} B");
    assert!(
        in_graph > kernel + 2 * x_bytes,
        "the control keeps {in_graph} B, no more than the kernel's {kernel} B: the kept-bytes \
         check would not see a composition left in the graph"
    );
    // Half precision: bf16 activations beside f32 weights, as a bf16 run has them.
    let inputs =
        [var(&[8, 64, 64], DType::BF16)?, var(&[64], DType::F32)?, var(&[64], DType::F32)?];
    check("layer_norm bf16", &op, &inputs, 2e-2)?;
    Ok(())
}

#[test]
fn softmax_on_the_generic_route() -> Result<()> {
    let _turn = turn();
    for mask in [Mask::None, Mask::Causal] {
        let op = move |t: &[Tensor]| ops::fused::softmax_last_dim(&t[0], 0.125, mask);
        let inputs = [var(&[2, 4, 64, 64], DType::F32)?];
        check(&format!("softmax mask={mask:?}"), &op, &inputs, 1e-5)?;
    }
    // The control: softmax composed in the graph keeps more than its output.
    let composed = |t: &[Tensor]| candle_nn::ops::softmax(&(&t[0] * 0.125)?, D::Minus1);
    let inputs = [var(&[2, 4, 64, 64], DType::F32)?];
    let kernel_op = |t: &[Tensor]| ops::fused::softmax_last_dim(&t[0], 0.125, Mask::None);
    let (in_graph, kernel) = (
        kept_bytes(&composed, &inputs, None)?,
        kept_bytes(&kernel_op, &inputs, Some(Path::Kernel))?,
    );
    eprintln!("softmax composed in the graph: kept {in_graph} B; the kernel {kernel} B");
    assert!(
        in_graph > kernel + 2 * 4 * 64 * 64 * 4,
        "the control keeps {in_graph} B, no more than the kernel's {kernel} B"
    );
    Ok(())
}

#[test]
fn dropout_gelu_and_linear_on_the_generic_route() -> Result<()> {
    let _turn = turn();
    let key = remat::rng::RngKey::named(7, "dropout");
    let dropout = move |t: &[Tensor]| ops::fused::dropout(&t[0], key, 0.1);
    check("dropout", &dropout, &[var(&[8, 64, 64], DType::F32)?], 0.0)?;
    for form in [GeluForm::Tanh, GeluForm::Erf] {
        let gelu = move |t: &[Tensor]| ops::fused::gelu(&t[0], form);
        check(&format!("gelu {form:?}"), &gelu, &[var(&[8, 64, 32], DType::F32)?], 1e-5)?;
    }
    for (layout, w_shape) in [(WeightLayout::InOut, [32, 48]), (WeightLayout::OutIn, [48, 32])] {
        let with_bias = move |t: &[Tensor]| ops::fused::linear(&t[0], &t[1], Some(&t[2]), layout);
        check(
            "linear with bias",
            &with_bias,
            &[var(&[4, 16, 32], DType::F32)?, var(&w_shape, DType::F32)?, var(&[48], DType::F32)?],
            1e-5,
        )?;
        let no_bias = move |t: &[Tensor]| ops::fused::linear(&t[0], &t[1], None, layout);
        check(
            "linear",
            &no_bias,
            &[var(&[4, 16, 32], DType::F32)?, var(&w_shape, DType::F32)?],
            1e-5,
        )?;
        let residual = move |t: &[Tensor]| ops::fused::linear_residual(&t[0], &t[1], &t[2], layout);
        let inputs = [
            var(&[4, 16, 32], DType::F32)?,
            var(&w_shape, DType::F32)?,
            var(&[4, 16, 48], DType::F32)?,
        ];
        let kernel = check("linear_residual", &residual, &inputs, 1e-5)?;
        // The control: the product, then the addition, whose node keeps the product too.
        let apart = move |t: &[Tensor]| &t[2] + ops::fused::linear(&t[0], &t[1], None, layout)?;
        let in_graph = kept_bytes(&apart, &inputs, Some(Path::Kernel))?;
        eprintln!("linear, then the residual's addition: kept {in_graph} B, as one op {kernel} B");
        // The product is 12 KiB (4 x 16 x 48 floats); half of it clears the pool's noise.
        assert!(
            in_graph > kernel + 4 * 16 * 48 * 4 / 2,
            "the control keeps {in_graph} B, linear_residual {kernel} B"
        );
    }
    Ok(())
}

/// A frozen linear layer with its LoRA adapter (rank 8, input dropout): the same values,
/// gradients and kept bytes on both routes.
#[test]
fn lora_linear_on_the_generic_route() -> Result<()> {
    let _turn = turn();
    let (op, inputs) = lora_case(LinearInput::AsIs)?;
    check("lora_linear", &op, &inputs, 1e-5)?;
    Ok(())
}

/// A frozen (48, 32) layer with a rank-8 adapter and input dropout, reading `input` of x; and its
/// operands x, a, b.
fn lora_case(input: LinearInput) -> Result<(Box<Op>, [Var; 3])> {
    let (w, bias) = (var(&[48, 32], DType::F32)?, var(&[48], DType::F32)?);
    let key = remat::rng::RngKey::named(3, "lora");
    let op = move |t: &[Tensor]| {
        let (base, adapter) = ((w.as_tensor(), Some(bias.as_tensor())), (&t[1], &t[2], 1.5));
        ops::fused::lora_linear(&t[0], input, base, WeightLayout::OutIn, adapter, Some((key, 0.1)))
    };
    let inputs =
        [var(&[4, 16, 32], DType::F32)?, var(&[8, 32], DType::F32)?, var(&[48, 8], DType::F32)?];
    Ok((Box::new(op), inputs))
}

/// A linear layer of a GELU's output as one op, plain and under a LoRA adapter: the same values,
/// gradients and kept bytes on both routes, and less kept than the GELU and the layer apart (the
/// control, which keeps the GELU's output too).
#[test]
fn gelu_linear_on_the_generic_route() -> Result<()> {
    let _turn = turn();
    let form = GeluForm::Erf;
    let op = move |t: &[Tensor]| {
        ops::fused::gelu_linear(&t[0], form, &t[1], Some(&t[2]), WeightLayout::OutIn)
    };
    let inputs =
        [var(&[4, 16, 32], DType::F32)?, var(&[48, 32], DType::F32)?, var(&[48], DType::F32)?];
    let kernel = check("gelu_linear", &op, &inputs, 1e-5)?;
    let apart = move |t: &[Tensor]| {
        ops::fused::linear(&ops::fused::gelu(&t[0], form)?, &t[1], Some(&t[2]), WeightLayout::OutIn)
    };
    let in_graph = kept_bytes(&apart, &inputs, Some(Path::Kernel))?;
    eprintln!("gelu, then linear: kept {in_graph} B, as one op {kernel} B");
    // The GELU's output is 8 KiB (4 x 16 x 32 floats); half of it clears the pool's noise.
    assert!(
        in_graph > kernel + 4 * 16 * 32 * 4 / 2,
        "the control keeps {in_graph} B, gelu_linear {kernel} B"
    );
    let (lora, inputs) = lora_case(LinearInput::Gelu(GeluForm::Tanh))?;
    check("lora_linear of a GELU", &lora, &inputs, 1e-5)?;
    Ok(())
}

/// A convolution of a BatchNorm + ReLU's output as one op (a ResNet bottleneck's, in 3D as the
/// U-Net's): the same values, gradients and kept bytes on both routes, and less kept than the
/// BatchNorm + ReLU and the convolution apart (the control, which keeps the ReLU's output too).
#[test]
fn batch_norm_relu_conv3d_on_the_generic_route() -> Result<()> {
    let _turn = turn();
    let g = ops::Conv3dGeometry::same(3);
    let op = move |t: &[Tensor]| {
        Ok(ops::fused::batch_norm_relu_conv3d((&t[0], &t[1], &t[2]), 1e-5, &t[3], g)?.0)
    };
    let inputs = [
        var(&[2, 4, 8, 8, 8], DType::F32)?,
        var(&[4], DType::F32)?,
        var(&[4], DType::F32)?,
        var(&[6, 4, 3, 3, 3], DType::F32)?,
    ];
    let kernel = check("batch_norm_relu_conv3d", &op, &inputs, 1e-5)?;
    let apart = move |t: &[Tensor]| {
        let y = ops::fused::batch_norm_train(&t[0], &t[1], &t[2], None, 1e-5, Activation::Relu)?.0;
        ops::conv3d(&y, &t[3], g)
    };
    let in_graph = kept_bytes(&apart, &inputs, Some(Path::Kernel))?;
    eprintln!("batch_norm + relu, then conv3d: kept {in_graph} B, as one op {kernel} B");
    // The ReLU's output is 16 KiB (2 x 4 x 8^3 floats); half of it clears the pool's noise.
    assert!(
        in_graph > kernel + 2 * 4 * 512 * 4 / 2,
        "the control keeps {in_graph} B, batch_norm_relu_conv3d {kernel} B"
    );
    Ok(())
}

#[test]
fn cross_entropy_on_the_generic_route() -> Result<()> {
    let _turn = turn();
    let targets = Tensor::new((0..64u32).map(|i| i * 37 % 512).collect::<Vec<_>>(), &Device::Cpu)?;
    let weights =
        Tensor::new((0..64).map(|i| f32::from(i % 3 != 0)).collect::<Vec<_>>(), &Device::Cpu)?;
    let t2 = targets.clone();
    let weighted = move |t: &[Tensor]| ops::fused::cross_entropy(&t[0], &t2, Some(&weights));
    check("cross_entropy weighted", &weighted, &[var(&[64, 512], DType::F32)?], 1e-5)?;
    let plain = move |t: &[Tensor]| ops::fused::cross_entropy(&t[0], &targets, None);
    check("cross_entropy", &plain, &[var(&[64, 512], DType::F32)?], 1e-5)?;
    Ok(())
}

#[test]
fn embedding_and_attention_on_the_generic_route() -> Result<()> {
    let _turn = turn();
    let ids = Tensor::new((0..512u32).map(|i| i * 7 % 1000).collect::<Vec<_>>(), &Device::Cpu)?
        .reshape((8, 64))?;
    let embedding = move |t: &[Tensor]| ops::fused::embedding(&t[0], &ids);
    check("embedding", &embedding, &[var(&[1000, 64], DType::F32)?], 1e-6)?;
    // Batch 2, 3 heads, 64 positions, 32 wide; the second sequence's last eight keys padded.
    let padding =
        Tensor::new((0..128).map(|i| f32::from(i < 120)).collect::<Vec<_>>(), &Device::Cpu)?
            .reshape((2, 64))?;
    let key = remat::rng::RngKey::named(5, "attention");
    for (mask, dropout) in
        [(Mask::None, None), (Mask::Causal, None), (Mask::Causal, Some((key, 0.1f32)))]
    {
        let padding = padding.clone();
        let attention = move |t: &[Tensor]| {
            ops::fused::attention(&t[0], &t[1], &t[2], 0.25, mask, Some(&padding), dropout)
        };
        let qkv = [
            var(&[2, 3, 64, 32], DType::F32)?,
            var(&[2, 3, 64, 32], DType::F32)?,
            var(&[2, 3, 64, 32], DType::F32)?,
        ];
        check(
            &format!("attention mask={mask:?} dropout={}", dropout.is_some()),
            &attention,
            &qkv,
            1e-5,
        )?;
    }
    Ok(())
}

/// The decoder ops of the Llama family: RMSNorm, the SiLU-gated product, attention with the rotary
/// embedding turned inside it over grouped key/value heads. Each keeps what its kernel keeps, and
/// less than the same op composed in the graph (the controls).
#[test]
fn rms_norm_silu_mul_and_rotary_attention_on_the_generic_route() -> Result<()> {
    let _turn = turn();
    let rms = |t: &[Tensor]| ops::fused::rms_norm(&t[0], &t[1], 1e-6);
    let inputs = [var(&[8, 64, 64], DType::F32)?, var(&[64], DType::F32)?];
    let kernel = check("rms_norm f32", &rms, &inputs, 1e-5)?;
    let composed = |t: &[Tensor]| {
        let scale = (t[0].sqr()?.mean_keepdim(D::Minus1)? + 1e-6)?.sqrt()?.recip()?;
        t[0].broadcast_mul(&scale)?.broadcast_mul(&t[1])
    };
    let in_graph = kept_bytes(&composed, &inputs, None)?;
    eprintln!("rms_norm composed in the graph: kept {in_graph} B");
    assert!(
        in_graph > kernel + 8 * 64 * 64 * 4,
        "the control keeps {in_graph} B, the kernel {kernel} B"
    );
    let inputs = [var(&[8, 64, 64], DType::BF16)?, var(&[64], DType::F32)?];
    check("rms_norm bf16", &rms, &inputs, 2e-2)?;

    let gated = |t: &[Tensor]| ops::fused::silu_mul(&t[0], &t[1]);
    let inputs = [var(&[8, 64, 64], DType::F32)?, var(&[8, 64, 64], DType::F32)?];
    let kernel = check("silu_mul", &gated, &inputs, 1e-5)?;
    let composed = |t: &[Tensor]| t[0].silu()? * &t[1];
    let in_graph = kept_bytes(&composed, &inputs, None)?;
    eprintln!("silu_mul composed in the graph: kept {in_graph} B");
    assert!(
        in_graph > kernel + 8 * 64 * 64 * 4,
        "the control keeps {in_graph} B, the kernel {kernel} B"
    );

    // Batch 2, 64 positions, 4 query heads over 2 key/value heads, 32 wide, dropout on; token by
    // token (B, T, heads, d).
    let rotary = ops::fused::Rotary::new((0..16).map(|i| 0.5f32.powi(i)).collect());
    let key = remat::rng::RngKey::named(5, "rotary attention");
    let inside = {
        let rotary = rotary.clone();
        move |t: &[Tensor]| {
            let dropout = Some((key, 0.1));
            ops::fused::rotary_attention(&t[0], &t[1], &t[2], &rotary, 0.25, Mask::Causal, dropout)
        }
    };
    let qkv = [
        var(&[2, 64, 4, 32], DType::F32)?,
        var(&[2, 64, 2, 32], DType::F32)?,
        var(&[2, 64, 2, 32], DType::F32)?,
    ];
    let kernel = check("rotary attention", &inside, &qkv, 1e-5)?;
    // Two controls, each keeping copies the op does not: q and k turned by candle's ops in the
    // graph (the op without its rotation, given turned operands), and the same op given q, k, v
    // heads first and its output turned back, each by a copy in the graph (which keeps its source
    // alive as well as itself).
    let heads_first = |x: &Tensor| x.transpose(1, 2)?.contiguous();
    let outside = move |t: &[Tensor]| {
        let half = |x: &Tensor, i: usize| x.narrow(D::Minus1, 16 * i, 16);
        let angles = Tensor::arange(0u32, 64, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .unsqueeze(1)?
            .broadcast_mul(
                &Tensor::new((0..16).map(|i| 0.5f32.powi(i)).collect::<Vec<_>>(), &Device::Cpu)?
                    .unsqueeze(0)?,
            )?;
        let angles = Tensor::cat(&[&angles, &angles], 1)?;
        let (cos, sin) = (angles.cos()?, angles.sin()?);
        let turn = |x: &Tensor| -> Result<Tensor> {
            let rotated = Tensor::cat(&[&half(x, 1)?.neg()?, &half(x, 0)?], D::Minus1)?;
            x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
        };
        let dropout = Some((key, 0.1));
        ops::fused::attention(
            &turn(&heads_first(&t[0])?)?,
            &turn(&heads_first(&t[1])?)?,
            &heads_first(&t[2])?,
            0.25,
            Mask::Causal,
            None,
            dropout,
        )
    };
    let in_graph = kept_bytes(&outside, &qkv, Some(Path::Kernel))?;
    eprintln!("rotary embedding composed before attention: kept {in_graph} B, inside {kernel} B");
    assert!(
        in_graph > kernel + 2 * 4 * 64 * 32 * 4,
        "the control keeps {in_graph} B, the rotary attention {kernel} B"
    );
    let copied = {
        let rotary = rotary.clone();
        move |t: &[Tensor]| {
            let dropout = Some((key, 0.1));
            let (q, k, v) = (heads_first(&t[0])?, heads_first(&t[1])?, heads_first(&t[2])?);
            // The op as it was: heads first in, heads first out (through the transposed views).
            let tokens_first = |x: &Tensor| x.transpose(1, 2);
            let y = ops::fused::rotary_attention(
                &tokens_first(&q)?,
                &tokens_first(&k)?,
                &tokens_first(&v)?,
                &rotary,
                0.25,
                Mask::Causal,
                dropout,
            )?;
            heads_first(&y)?.transpose(1, 2)?.contiguous()
        }
    };
    let in_graph = kept_bytes(&copied, &qkv, Some(Path::Kernel))?;
    eprintln!("attention over heads-first copies: kept {in_graph} B, token by token {kernel} B");
    // At least the copies of q, k and v (4 + 2 + 2 heads' rows of (2, 64, 32) floats) and one
    // of the output (4).
    assert!(
        in_graph > kernel + 12 * 2 * 64 * 32 * 4,
        "the control keeps {in_graph} B, the rotary attention {kernel} B"
    );
    check("rotary attention bf16", &inside, &qkv, 2e-2)?;
    Ok(())
}

#[test]
fn batch_norm_on_the_generic_route() -> Result<()> {
    let _turn = turn();
    let cases =
        [(Activation::Identity, false), (Activation::Relu, false), (Activation::Relu, true)];
    for (activation, residual) in cases {
        let op = move |t: &[Tensor]| {
            Ok(ops::fused::batch_norm_train(
                &t[0],
                &t[1],
                &t[2],
                residual.then(|| &t[3]),
                1e-5,
                activation,
            )?
            .0)
        };
        let mut inputs =
            vec![var(&[4, 8, 16, 16], DType::F32)?, var(&[8], DType::F32)?, var(&[8], DType::F32)?];
        if residual {
            inputs.push(var(&[4, 8, 16, 16], DType::F32)?);
        }
        check(&format!("batch_norm {activation:?} residual={residual}"), &op, &inputs, 1e-5)?;
    }
    // A downsampling block's end: two BatchNorms added, a ReLU. The control: the projection's
    // BatchNorm as an op of its own, its output kept as the other's residual operand.
    let pair = |t: &[Tensor]| {
        Ok(ops::fused::batch_norm_pair_train((&t[0], &t[1], &t[2]), (&t[3], &t[4], &t[5]), 1e-5)?.0)
    };
    let (x, c) = ([4, 8, 16, 16], [8]);
    let inputs = [
        var(&x, DType::F32)?,
        var(&c, DType::F32)?,
        var(&c, DType::F32)?,
        var(&x, DType::F32)?,
        var(&c, DType::F32)?,
        var(&c, DType::F32)?,
    ];
    let pair_kernel = check("batch_norm pair", &pair, &inputs, 1e-5)?;
    let as_residual = |t: &[Tensor]| {
        let r =
            ops::fused::batch_norm_train(&t[3], &t[4], &t[5], None, 1e-5, Activation::Identity)?.0;
        Ok(ops::fused::batch_norm_train(&t[0], &t[1], &t[2], Some(&r), 1e-5, Activation::Relu)?.0)
    };
    let as_residual_kept = kept_bytes(&as_residual, &inputs, Some(Path::Kernel))?;
    eprintln!("batch_norm pair as two ops: kept {as_residual_kept} B, as one {pair_kernel} B");
    assert!(
        as_residual_kept + SLACK > pair_kernel + 4 * 8 * 256 * 4,
        "the control keeps {as_residual_kept} B, the pair op {pair_kernel} B"
    );
    // 3D, as the U-Net has it.
    let op = |t: &[Tensor]| {
        Ok(ops::fused::batch_norm_train(&t[0], &t[1], &t[2], None, 1e-5, Activation::Relu)?.0)
    };
    let inputs =
        [var(&[2, 4, 8, 8, 8], DType::F32)?, var(&[4], DType::F32)?, var(&[4], DType::F32)?];
    let kernel = check("batch_norm 3d relu", &op, &inputs, 1e-5)?;
    // The control: BatchNorm + ReLU composed in the graph keeps the centred input, the normalised
    // one and the output before the ReLU.
    let composed = |t: &[Tensor]| {
        let (x, shape) = (&t[0], (1, 4, 1, 1, 1));
        let mean = x.mean_keepdim((0, 2, 3, 4))?;
        let centred = x.broadcast_sub(&mean)?;
        let var = centred.sqr()?.mean_keepdim((0, 2, 3, 4))?;
        let normal = centred.broadcast_div(&(var + 1e-5)?.sqrt()?)?;
        normal.broadcast_mul(&t[1].reshape(shape)?)?.broadcast_add(&t[2].reshape(shape)?)?.relu()
    };
    let in_graph = kept_bytes(&composed, &inputs, None)?;
    eprintln!("batch_norm composed in the graph: kept {in_graph} B");
    assert!(
        in_graph > kernel + 2 * 2 * 4 * 512 * 4,
        "the control keeps {in_graph} B, no more than the kernel's {kernel} B"
    );
    let inputs =
        [var(&[2, 4, 8, 8, 8], DType::BF16)?, var(&[4], DType::F32)?, var(&[4], DType::F32)?];
    check("batch_norm bf16", &op, &inputs, 2e-2)?;
    Ok(())
}

#[test]
fn convolutions_and_pooling_on_the_generic_route() -> Result<()> {
    let _turn = turn();
    let same = ops::Conv3dGeometry::same(3);
    let strided = ops::Conv3dGeometry { stride_d: 2, stride_hw: 2, pad_d: 1, pad_hw: 1 };
    for (name, g) in [("conv3d same", same), ("conv3d strided", strided)] {
        let op = move |t: &[Tensor]| ops::conv3d(&t[0], &t[1], g);
        check(
            name,
            &op,
            &[var(&[2, 4, 8, 8, 8], DType::F32)?, var(&[6, 4, 3, 3, 3], DType::F32)?],
            1e-5,
        )?;
    }
    let concat = move |t: &[Tensor]| ops::conv3d_concat(&t[0], &t[1], &t[2], same);
    let concat_inputs = [
        var(&[2, 4, 8, 8, 8], DType::F32)?,
        var(&[2, 6, 8, 8, 8], DType::F32)?,
        var(&[4, 10, 3, 3, 3], DType::F32)?,
    ];
    let concat_kernel = check("conv3d concat", &concat, &concat_inputs, 1e-5)?;
    // The control: the concatenation made in the graph, which the convolution keeps as its input.
    let concat_composed =
        move |t: &[Tensor]| ops::conv3d(&Tensor::cat(&[&t[0], &t[1]], 1)?, &t[2], same);
    let concat_in_graph = kept_bytes(&concat_composed, &concat_inputs, Some(Path::Kernel))?;
    eprintln!(
        "conv3d of a concatenation made in the graph: kept {concat_in_graph} B, conv3d_concat \
         {concat_kernel} B"
    );
    assert!(
        concat_in_graph + SLACK > concat_kernel + 2 * 10 * 512 * 4,
        "the control keeps {concat_in_graph} B, conv3d_concat {concat_kernel} B"
    );
    // Large enough that the composed convolution runs in several chunks of slices per sample
    // (8 x 27 x 32 x 32 column entries per slice: 9 slices per chunk, 16 output depths).
    let op = move |t: &[Tensor]| ops::conv3d(&t[0], &t[1], same);
    check(
        "conv3d chunked",
        &op,
        &[var(&[2, 8, 16, 32, 32], DType::F32)?, var(&[4, 8, 3, 3, 3], DType::F32)?],
        1e-5,
    )?;
    // And a 2D one in chunks of samples (16 x 9 x 64 x 64 entries per sample: 3 per chunk).
    let op = |t: &[Tensor]| ops::conv2d(&t[0], &t[1], 1, 1);
    check(
        "conv2d chunked",
        &op,
        &[var(&[4, 16, 64, 64], DType::F32)?, var(&[8, 16, 3, 3], DType::F32)?],
        1e-5,
    )?;
    for (k, padding, stride) in [(3, 1, 1), (3, 1, 2), (1, 0, 2), (7, 3, 2)] {
        let op = move |t: &[Tensor]| ops::conv2d(&t[0], &t[1], padding, stride);
        check(
            &format!("conv2d k{k} s{stride}"),
            &op,
            &[var(&[2, 8, 16, 16], DType::F32)?, var(&[16, 8, k, k], DType::F32)?],
            1e-5,
        )?;
    }
    let up = |t: &[Tensor]| ops::conv_transpose3d_k2s2(&t[0], &t[1], &t[2]);
    check(
        "conv_transpose3d",
        &up,
        &[
            var(&[2, 8, 4, 4, 4], DType::F32)?,
            var(&[8, 4, 2, 2, 2], DType::F32)?,
            var(&[4], DType::F32)?,
        ],
        1e-5,
    )?;
    let pool = |t: &[Tensor]| ops::max_pool2d_k3s2p1(&t[0]);
    let kernel = check("max_pool2d", &pool, &[var(&[2, 8, 17, 16], DType::F32)?], 1e-6)?;
    let pool3d = |t: &[Tensor]| ops::max_pool3d_k2s2(&t[0]);
    check("max_pool3d", &pool3d, &[var(&[2, 8, 9, 8, 8], DType::F32)?], 1e-6)?;
    // The controls: the composed up-convolution keeps its product and the permuted copy; a 3x3
    // maximum filter composed in the graph keeps its padded copies and the row maxima.
    let up_inputs = [
        var(&[2, 8, 4, 4, 4], DType::F32)?,
        var(&[8, 4, 2, 2, 2], DType::F32)?,
        var(&[4], DType::F32)?,
    ];
    let up_composed = |t: &[Tensor]| {
        let (x, w, b) = (&t[0], &t[1], &t[2]);
        let cols = x.permute((0, 2, 3, 4, 1))?.reshape((128, 8))?.matmul(&w.reshape((8, 32))?)?;
        cols.reshape(vec![2, 4, 4, 4, 4, 2, 2, 2])?
            .permute([0, 4, 1, 5, 2, 6, 3, 7])?
            .reshape((2, 4, 8, 8, 8))?
            .broadcast_add(&b.reshape((1, 4, 1, 1, 1))?)
    };
    let up_kernel = kept_bytes(&up, &up_inputs, Some(Path::Kernel))?;
    let up_in_graph = kept_bytes(&up_composed, &up_inputs, None)?;
    eprintln!(
        "conv_transpose3d composed in the graph: kept {up_in_graph} B, the kernel {up_kernel} B"
    );
    assert!(
        up_in_graph > up_kernel + 2 * 2 * 4 * 512 * 4,
        "the control keeps {up_in_graph} B, no more than the kernel's {up_kernel} B"
    );
    let pool_inputs = [var(&[2, 8, 17, 16], DType::F32)?];
    let pool_composed = |t: &[Tensor]| {
        let x = t[0].pad_with_same(2, 1, 1)?.pad_with_same(3, 1, 1)?;
        let rows =
            x.narrow(2, 0, 17)?.maximum(&x.narrow(2, 1, 17)?)?.maximum(&x.narrow(2, 2, 17)?)?;
        rows.narrow(3, 0, 16)?.maximum(&rows.narrow(3, 1, 16)?)?.maximum(&rows.narrow(3, 2, 16)?)
    };
    let pool_in_graph = kept_bytes(&pool_composed, &pool_inputs, None)?;
    eprintln!("max_pool2d composed in the graph: kept {pool_in_graph} B, the kernel {kernel} B");
    assert!(
        pool_in_graph > kernel + 2 * 2 * 8 * 17 * 16 * 4,
        "the control keeps {pool_in_graph} B, no more than the kernel's {kernel} B"
    );
    Ok(())
}
