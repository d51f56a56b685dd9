//! Checkpointing lowers the measured peak of a ResNet training step, and the activation peaks of
//! `off` and `sqrt` stay within 10 % of figures derived from the shapes. The only test in its binary:
//! the counting allocator is process-wide, and tests of one binary run concurrently.

use candle_core::Device;
use datasets::images::SyntheticImages;
use remat::memory::CountingAlloc;
use remat::Executor;
use resnet::{Config, ResNet};
use trainkit::{assert_near_figure, Peaks};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn peaks(policy: &str) -> Peaks {
    let (batch, size) = (2, 128);
    let model = ResNet::new(Config { classes: 4, ..("tiny".parse().unwrap()) }, &Device::Cpu, 1).unwrap();
    let exec = Executor::new(model.graph(), &policy.parse().unwrap(), model.params().vars(), 1).unwrap();
    let data = SyntheticImages::new(4, size, 1);
    trainkit::second_step_peaks(&exec, |step| {
        let (x, y) = data.batch(step, batch);
        model.inputs(&x, &y, size, &Device::Cpu).unwrap()
    })
    .unwrap()
}

/// Thresholds from measurements on a 2-core machine (before-downsample 0.41-0.49, sqrt 0.74-0.82 of off).
/// `sqrt` saves less on a ResNet than on a transformer: its first segment holds the stem and the
/// first blocks, whose activations are the largest (highest resolution).
#[test]
fn checkpointing_lowers_the_step_peak_and_nothing_leaks() {
    // One thread: with two, how far candle's per-thread conv buffers overlap our own parallel
    // kernels in backward moves the peak by about 2.1 MB from run to run. Set before candle or
    // rayon read it, as this is the only test in its binary.
    std::env::set_var("RAYON_NUM_THREADS", "1");
    training_does_not_grow_the_heap();
    let off = peaks("off");
    for (policy, max_ratio) in [("before-downsample", 0.6), ("sqrt", 0.9)] {
        let p = peaks(policy);
        let ratio = p.step as f64 / off.step as f64;
        eprintln!("{policy}: {ratio:.3} of off ({} B)", off.step);
        assert!(ratio <= max_ratio, "{policy}: step peak is {ratio:.3} of off, expected at most {max_ratio}");
        if policy == "sqrt" {
            assert_near_figure("sqrt activation peak", p.activation, SQRT_ACTIVATION);
        }
    }
    assert_near_figure("off activation peak", off.activation, OFF_ACTIVATION);
}

/// The heap after a step (model, optimizer state) must not grow from step to step: an optimizer
/// that does arithmetic on Vars without detaching keeps every earlier step's tensors alive.
fn training_does_not_grow_the_heap() {
    use candle_nn::Optimizer;
    let model = ResNet::new(Config { classes: 4, ..("tiny".parse().unwrap()) }, &Device::Cpu, 1).unwrap();
    let exec = Executor::new(model.graph(), &"sqrt".parse().unwrap(), model.params().vars(), 1).unwrap();
    let mut opt = layers::SgdMomentum::new(model.params().vars(), Default::default()).unwrap();
    let data = SyntheticImages::new(4, 32, 1);
    let mut after = Vec::new();
    for step in 0..4 {
        let (x, y) = data.batch(step, 4);
        let out = exec.step(&model.inputs(&x, &y, 32, &Device::Cpu).unwrap(), step).unwrap();
        opt.step(&out.grads).unwrap();
        drop(out);
        after.push(remat::memory::heap_current());
    }
    assert_eq!(after[1], after[3], "the heap grew from {} to {} bytes between steps 1 and 3", after[1], after[3]);
}

// The committed activation peaks of the `tiny` preset (bottleneck blocks [1, 2, 2, 1], width 8) at
// batch 2, 128x128, from the shapes. A conv followed by the fused BatchNorm (+ ReLU) holds 2
// tensors of the conv's output size: the conv output and the normalised output (`layers::fused`
// keeps nothing else). Stem: 2 x (2 x 8 x 64 x 64 f32 = 256 KiB) = 0.52 MB. Stem pool: 6.1 of its
// quarter-size output (the -inf padded copies and pairwise maxima, rows then columns): 1.60 MB. A
// bottleneck block with u = its input's size per plane: 2 + 2 (conv1, conv2) + 2 x 4 (conv3) + 2 x
// 4 (downsample) + 4 + 4 (add, ReLU) = 28 u; layer1.0 at u = 2 x 8 x 32 x 32 f32 = 64 KiB holds
// 1.84 MB (1.84 MB measured), each later layer's blocks about a third to a half of the one before:
// 6.9 MB at the end of forward. candle's backward then adds 1.1x of that in gradients while the
// forward graph is still held (measured single-threaded, see the test; not derived): `off` 14.7
// MB. `sqrt` stores one boundary (ceil(sqrt(6)) = 3 blocks a segment: the output of layer2.0); the
// recomputed first segment holds 5.1 MB, and its backward adds its gradients on top of those
// flowing in: 11.5 MB. (The high-resolution stem and layer1 dominate, hence the small saving: the
// ratio test above says why.)
const OFF_ACTIVATION: u64 = 14_746_668;
const SQRT_ACTIVATION: u64 = 11_530_988;
