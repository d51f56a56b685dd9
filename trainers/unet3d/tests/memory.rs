//! Checkpointing lowers the measured step peak of a 3D U-Net, and the activation peaks of `off`
//! and `sqrt` stay within 10 % of figures derived from the shapes. The only test in its binary: the
//! counting allocator is process-wide, and tests of one binary run concurrently.

use candle_core::Device;
use datasets::volumes::SyntheticVolumes;
use remat::memory::CountingAlloc;
use remat::Executor;
use testkit::{assert_near_figure, Peaks};
use trainable::Model;
use unet3d::UNet3d;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn peaks(policy: &str) -> Peaks {
    let side = 24;
    let model = UNet3d::new(unet3d::Preset::Tiny.config(), &Device::Cpu, 1).unwrap();
    let exec =
        Executor::new(model.graph(), &policy.parse().unwrap(), model.params().vars(), 1).unwrap();
    let data = SyntheticVolumes::new(side, 1);
    testkit::second_step_peaks(&exec, |step| {
        let (x, y) = data.batch(step, 2);
        model.inputs(&x, &y, side, &Device::Cpu).unwrap()
    })
    .unwrap()
}

/// `before-downsample` stores the skip tensors and recomputes the analysis path; the synthesis
/// path is the last segment, kept from forward, so the step's peak stays in dec.0's backward.
/// There `off` still holds enc.0's internal tensors, which `before-downsample` dropped (it
/// stores enc.0's output, the skip): the first convolution's output (4 channels; its norm's
/// output is never kept, the second convolution normalises it again) and the second
/// convolution's output (8 channels), 3 v with v = 2 x 4 x 24^3 f32 (the smaller levels'
/// internals come on top). `every-two-blocks` cuts the decoder too, so it holds
/// less again.
#[test]
fn checkpointing_lowers_the_step_peak() {
    let off = peaks("off");
    let v = 2 * 4 * 24u64.pow(3) * 4;
    let (downsample, two) = (peaks("before-downsample").step, peaks("every-two-blocks").step);
    eprintln!(
        "step peaks: off {} B, before-downsample {downsample} B, every-two-blocks {two} B; 3 v = \
         {} B",
        off.step,
        3 * v
    );
    assert!(
        downsample + 3 * v <= off.step,
        "before-downsample: step peak {downsample} B, not 3 v = {} B below off's {} B",
        3 * v,
        off.step
    );
    assert!(
        two < downsample,
        "every-two-blocks: step peak {two} B, not below before-downsample's {downsample} B"
    );
    assert_near_figure("off activation peak", off.activation, OFF_ACTIVATION);
    assert_near_figure("sqrt activation peak", peaks("sqrt").activation, SQRT_ACTIVATION);
}

// The committed activation peaks of the `tiny` preset (base 4, 2 levels, BatchNorm) at batch 2,
// 24^3, from the shapes. The fused conv3d keeps nothing but its input and output (its column
// matrix is built again in backward), the fused BatchNorm + ReLU likewise, and a level's second
// convolution takes the first one's norm and ReLU into its op, keeping the norm's input only: a
// level holds its first convolution's output and its second's with the norm's output after it.
// With v = 2 x 4 x 24^3 f32 = 432 KiB: enc.0 (1 -> 4 -> 8 channels) holds v + 2 x 2 v = 5 v =
// 2.21 MB; the fused pool keeps only its
// output beyond its input; enc.1 and bottom at an eighth and a sixty-fourth of the voxels; dec.1
// and dec.0 keep their up-sampled tensor, which their first convolution reads beside the skip
// (the concatenation is never made; the fused up-convolution keeps only its input); each stage
// reads its inputs through `Var`s over their memory. The step's peak is in backward:
// dec.0's, a slab of its padded input planes and the input gradients on top of what is still
// held (measured, not derived): `off` 13.5 MB (15 MB while the first norm's output was kept,
// 18 MB with the patch matrix's blocks, which the direct kernels do not make, 24 MB with an
// 8 MiB patch workspace and whole samples copied channels-last, 28 MB when the concatenation,
// the pool's partial maxima and the head's permuted voxels were kept). `sqrt` cuts after
// `bottom` (segments enc.0..bottom, dec.1..head): the last segment, kept from forward, holds
// dec.1 + dec.0 + head, and its backward reaches 11.6 MB (13 with the first norm's output, 16
// with patch blocks, 21).
// The full-resolution decoder, never recomputed, sets both peaks, which is why checkpointing
// saves little on this model.
const OFF_ACTIVATION: u64 = 13_471_456;
const SQRT_ACTIVATION: u64 = 11_579_524;
