//! The measured memory of a deep BERT step: `sqrt` at least halves the step peak, and the
//! activation peaks of `off` and `sqrt` stay within 10 % of figures derived from the shapes. The
//! only test in its binary: the counting allocator is process-wide, and tests of one binary run
//! concurrently.

use bert::{Bert, Config, MlmData};
use candle_core::Device;
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
    let model = Bert::new(cfg.clone(), &Device::Cpu, 3).unwrap();
    let exec =
        Executor::new(model.graph(), &policy.parse().unwrap(), model.params().vars(), 3).unwrap();
    let data = MlmData::synthetic(cfg.vocab_size, SEQ, 1).unwrap();
    testkit::second_step_peaks(&exec, |step| {
        model.inputs(&data.batch(step, BATCH), &Device::Cpu).unwrap()
    })
    .unwrap()
}

#[test]
fn sqrt_halves_the_step_peak_and_activation_peaks_match_the_shapes() {
    testkit::assert_deep_model_memory(peaks, off_forward_end(), OFF_ACTIVATION, SQRT_ACTIVATION);
}

/// The end of `off`'s forward from the shapes (derived below): 20 BTC per layer, 5 for the
/// embeddings, and the MLM head's dense layer, GELU and LayerNorm (3) and its logits (B, T, V)
/// twice (the product and the bias added to it).
fn off_forward_end() -> u64 {
    let btc = (BATCH * SEQ * 64 * 4) as u64;
    let logits = (BATCH * SEQ * Config::tiny(LAYERS, 64).vocab_size * 4) as u64;
    (20 * LAYERS as u64 + 5 + 3) * btc + 2 * logits
}

// The end of forward, from the shapes (checked within 5 %); the activation peaks, measured and
// committed (within 10 %: they include candle's gradients in flight, which are not derived). Unit:
// BTC = 2 x 128 x 64 f32 = 64 KiB. Forward, per layer, candle's graph holds every intermediate that
// feeds another op; the `ops::fused` ops keep only their output: q, k, v 6 BTC (fused linear, whose
// product before the bias is no node, then a contiguous copy of the head transpose); the fused
// attention's output 1 (scores and probabilities are rebuilt in backward: no (T, T) map is kept)
// and the merge-heads copy 1; attention projection 1, its dropout 1 (no mask kept), residual add 1,
// LayerNorm 1; intermediate 4 (the GELU runs inside the output layer's op, which keeps only its
// input: the GELU's 4 more were kept while it was an op of its own); output 1, dropout 1, add 1,
// LayerNorm 1: 20 BTC = 1.31 MB per layer. `off`: 24 layers + embeddings (0.33 MB) + MLM head
// (1.2 MB) = 33 MB at the end of forward; candle's backward adds the gradients in flight
// (measured, not derived; the GELU's backward is one pass): 34 MB (41 MB while the GELU's output
// was kept). `sqrt`: segments of 5 layers; a recomputed segment holds 5 x 1.31 = 6.6 MB plus the
// embeddings or the stored boundaries, and its backward's gradients: 8.8 MB (10 MB). (With a composed dropout, candle's backward would also keep,
// until it returned, a gradient for every dropout mask: a constant operand of a product, whose
// gradient candle computes and stores but never releases; that would add most of 0.4-0.6x.)
const OFF_ACTIVATION: u64 = 33_761_522;
const SQRT_ACTIVATION: u64 = 8_807_586;
