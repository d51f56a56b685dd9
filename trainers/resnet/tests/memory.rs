//! Checkpointing lowers the measured memory of a ResNet training step, by at least what the
//! shapes say it must: a ResNet wide enough that its activations, not the stem convolution's
//! backward, set the peak. The only test in its binary: the counting allocator is process-wide,
//! and tests of one binary run concurrently.

use candle_core::Device;
use datasets::images::SyntheticImages;
use remat::memory::CountingAlloc;
use remat::Executor;
use resnet::{Config, ResNet};
use testkit::Peaks;
use trainable::Model;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const BATCH: usize = 2;
const SIZE: usize = 64;

/// Bottleneck blocks [2, 2, 2, 2] of width 32: at 64x64 the blocks' activations outweigh the stem
/// convolution's column matrix (3 x 49 values per output pixel, whatever the width), which set
/// the peak of the `tiny` preset under every policy.
fn config() -> Config {
    Config {
        bottleneck: true,
        layers: [2, 2, 2, 2],
        width: 32,
        classes: 4,
        dtype: trainable::Precision::F32,
        freeze: params::Freeze::default(),
    }
}

fn model() -> ResNet {
    ResNet::new(config(), &Device::Cpu, 1).unwrap()
}

fn inputs(model: &ResNet, step: u64) -> Vec<candle_core::Tensor> {
    let (x, y) = SyntheticImages::new(4, SIZE, 1).batch(step, BATCH);
    model.inputs(&x, &y, SIZE, &Device::Cpu).unwrap()
}

fn peaks(policy: &str) -> Peaks {
    let model = model();
    let exec =
        Executor::new(model.graph(), &policy.parse().unwrap(), model.params().vars(), 1).unwrap();
    testkit::second_step_peaks(&exec, |step| inputs(&model, step)).unwrap()
}

/// Bytes of every stage's outputs, from their shapes: what `off` holds at the end of forward at
/// the least (each output is kept for the next stage's backward), and the largest single one.
fn stage_outputs() -> (u64, u64) {
    let model = model();
    let ctx = |i| remat::StageCtx::new(remat::RunPoint { seed: 1, stage: i, ..Default::default() });
    let mut values = inputs(&model, 0);
    let (mut all, mut largest) = (0, 0);
    let graph = model.graph();
    let n = graph.nodes().len();
    // A chain: each stage reads the previous one's output (and the labels at the head).
    let mut x = values.remove(0);
    for (i, node) in graph.nodes().iter().enumerate().take(n - 1) {
        x = node.stage.forward(&[x], &ctx(i)).unwrap().remove(0).detach();
        let bytes = remat::memory::tensor_bytes(&x);
        all += bytes;
        largest = largest.max(bytes);
    }
    (all, largest)
}

#[test]
fn checkpointing_lowers_the_activation_peak_by_what_the_shapes_say() {
    // One thread: with two, how far candle's per-thread conv buffers overlap our own parallel
    // kernels in backward moves the peak from run to run. Set before candle or rayon read it, as
    // this is the only test in its binary.
    std::env::set_var("RAYON_NUM_THREADS", "1");
    training_does_not_grow_the_heap();
    let (outputs, largest) = stage_outputs();
    let off = peaks("off");
    eprintln!(
        "off: forward ends at {} B, activation peak {} B, step peak {} B; stage outputs {outputs} \
         B (largest {largest} B)",
        off.forward_end, off.activation, off.step
    );
    assert!(
        off.forward_end >= outputs,
        "off ends its forward with {} B, less than the stage outputs' {outputs} B",
        off.forward_end
    );
    for policy in ["sqrt", "before-downsample"] {
        let p = peaks(policy);
        eprintln!(
            "{policy}: forward ends at {} B, activation peak {} B ({:.2}x off), step peak {} B \
             ({:.2}x off)",
            p.forward_end,
            p.activation,
            p.activation as f64 / off.activation as f64,
            p.step,
            p.step as f64 / off.step as f64
        );
        // A segmented forward keeps at most its boundaries and the last segment: it must end
        // below off's by at least the outputs it does not keep, so at least by half of them.
        assert!(
            p.forward_end + outputs / 2 <= off.forward_end,
            "{policy}: forward ends at {} B, off at {} B",
            p.forward_end,
            off.forward_end
        );
        assert!(
            p.activation * 4 <= off.activation * 3,
            "{policy}: activation peak {} B is more than 3/4 of off's {} B",
            p.activation,
            off.activation
        );
    }
}

/// The heap after a step (model, optimizer state) must not grow from step to step: an optimizer
/// that does arithmetic on Vars without detaching keeps every earlier step's tensors alive.
fn training_does_not_grow_the_heap() {
    use candle_nn::Optimizer;
    let model =
        ResNet::new(Config { classes: 4, ..resnet::Preset::Tiny.config() }, &Device::Cpu, 1)
            .unwrap();
    let exec =
        Executor::new(model.graph(), &"sqrt".parse().unwrap(), model.params().vars(), 1).unwrap();
    let mut opt = optim::SgdMomentum::new(model.params().vars(), Default::default()).unwrap();
    let data = SyntheticImages::new(4, 32, 1);
    let mut after = Vec::new();
    for step in 0..4 {
        let (x, y) = data.batch(step, 4);
        let out = exec.step(&model.inputs(&x, &y, 32, &Device::Cpu).unwrap(), step).unwrap();
        opt.step(&out.grads).unwrap();
        drop(out);
        after.push(remat::memory::heap_current());
    }
    assert_eq!(
        after[1], after[3],
        "the heap grew from {} to {} bytes between steps 1 and 3",
        after[1], after[3]
    );
}
