//! The measured memory of a deep GPT-2 step: `sqrt` at least halves the step peak, and the
//! activation peaks of `off` and `sqrt` stay within 10 % of figures derived from the shapes. The
//! only test in its binary: the counting allocator is process-wide, and tests of one binary run
//! concurrently.

use candle_core::Device;
use datasets::tokens::Batcher;
use gpt2::{Config, Gpt2};
use remat::memory::CountingAlloc;
use remat::Executor;
use testkit::Peaks;
use trainable::Model;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const LAYERS: usize = 24;
const BATCH: usize = 2;
const SEQ: usize = 128;

fn peaks(policy: &str) -> Peaks {
    let cfg = Config::tiny(LAYERS, 64);
    let model = Gpt2::new(cfg.clone(), &Device::Cpu, 3).unwrap();
    let exec =
        Executor::new(model.graph(), &policy.parse().unwrap(), model.params().vars(), 3).unwrap();
    let text = datasets::text::synthetic_corpus(1, 100_000);
    let data = Batcher::new(datasets::text::byte_tokens(&text), SEQ, cfg.vocab_size, 1).unwrap();
    testkit::second_step_peaks(&exec, |step| {
        let (x, y) = data.batch(step, BATCH);
        model.inputs(&x, &y, BATCH, SEQ, &Device::Cpu).unwrap()
    })
    .unwrap()
}

#[test]
fn sqrt_halves_the_step_peak_and_activation_peaks_match_the_shapes() {
    testkit::assert_deep_model_memory(peaks, off_forward_end(), OFF_ACTIVATION, SQRT_ACTIVATION);
    // Selective recompute keeps, in each block of a recomputed segment (20 of the 24 under
    // `sqrt`), the outputs of its four projections and of attention: c_attn 3 BTC, attention 1,
    // its projection 1, c_fc 4, the MLP's projection 1.
    let btc = (BATCH * SEQ * 64 * 4) as u64;
    testkit::assert_keeping_holds_the_kept_outputs(
        peaks,
        "sqrt",
        "matmul+attention",
        20 * 10 * btc,
    );
}

/// The end of `off`'s forward from the shapes (derived below): 23 BTC per block, 3 for the
/// embedding, the final LayerNorm's 1 and the logits (B, T, V).
fn off_forward_end() -> u64 {
    let btc = (BATCH * SEQ * 64 * 4) as u64;
    let logits = (BATCH * SEQ * Config::tiny(LAYERS, 64).vocab_size * 4) as u64;
    (23 * LAYERS as u64 + 3 + 1) * btc + logits
}

// The end of forward, from the shapes (checked within 5 %); the activation peaks, measured and
// committed (within 10 %: they include candle's gradients in flight, which are not derived). Unit:
// one (B, T, C) tensor, BTC = 2 x 128 x 64 f32 = 64 KiB. Forward, per block, candle's graph holds
// every intermediate that feeds another op; the `ops::fused` ops keep only their output: the two
// LayerNorms 1 BTC each; c_attn 3 (one fused linear: the product before the bias is no node); q, k,
// v 6 (each a copy out of the packed projection, then a contiguous copy of its transpose); the
// fused attention's output 1 (scores and probabilities are rebuilt in backward: no (T, T) map is
// kept) and the merge-heads copy 1; the two projections 1 + 1; c_fc 4 (the GELU runs inside the
// MLP's projection's op, which keeps only its input: the GELU's 4 more were kept while it was an op
// of its own); two residual dropouts 1 + 1 (no mask kept); two residual adds 2: 23 BTC = 1.51 MB
// per block. `off`: 24 blocks + embedding (3 BTC) + head (LayerNorm, logits: 0.33 MB; the fused
// cross-entropy keeps nothing) = 37 MB at the end of forward; candle's backward then adds the
// gradients in flight (measured, not derived; the GELU's backward is one pass): 38 MB (45 MB while
// the GELU's output was kept). `sqrt`: segments of 5 blocks; a recomputed segment holds 5 x 1.51 =
// 7.5 MB plus the stored boundaries and the incoming gradient, and its backward's gradients: 9.6
// MB (11 MB).
const OFF_ACTIVATION: u64 = 38_277_992;
const SQRT_ACTIVATION: u64 = 9_570_560;
