//! Checkpointing lowers the measured step peak of a 3D U-Net. The only test in its binary: the
//! counting allocator is process-wide, and tests of one binary run concurrently.

use candle_core::Device;
use datasets::volumes::SyntheticVolumes;
use remat::memory::CountingAlloc;
use remat::Executor;
use unet3d::UNet3d;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Heap peak of the second step (see `trainkit::second_step_peak`).
fn step_peak(policy: &str) -> u64 {
    let side = 32;
    let model = UNet3d::new("tiny".parse().unwrap(), &Device::Cpu, 1).unwrap();
    let exec = Executor::new(model.graph(), &policy.parse().unwrap(), model.params().vars(), 1).unwrap();
    let data = SyntheticVolumes::new(side, 1);
    trainkit::second_step_peak(&exec, |step| {
        let (x, y) = data.batch(step, 2);
        model.inputs(&x, &y, side, &Device::Cpu).unwrap()
    })
    .unwrap()
}

/// Thresholds from measurements on a 2-core machine (0.79 and 0.66 of off). `before-downsample` stores the skip tensors
/// and recomputes the analysis path; the synthesis path is the last segment, kept from forward,
/// so it saves less than `every-two-blocks`, which cuts the decoder too.
#[test]
fn checkpointing_lowers_the_step_peak() {
    let off = step_peak("off") as f64;
    for (policy, max_ratio) in [("before-downsample", 0.88), ("every-two-blocks", 0.75)] {
        let ratio = step_peak(policy) as f64 / off;
        eprintln!("{policy}: {ratio:.3} of off ({off} B)");
        assert!(ratio <= max_ratio, "{policy}: step peak is {ratio:.3} of off, expected at most {max_ratio}");
    }
}
