//! The 3D U-Net under checkpointing: its skip edges cross segments, and BatchNorm runs in every
//! level; gradients and running statistics still equal `off` bit for bit; its snapshots load back.

use candle_core::Device;
use datasets::volumes::SyntheticVolumes;
use remat::{Executor, Policy};
use testkit::checkpointing::{Control, Training};
use trainable::Model;
use unet3d::{Config, Loss, UNet3d};

fn tiny() -> Config {
    unet3d::Preset::Tiny.config()
}

/// A tiny U-Net of `config`, trained with AdamW on batches of 2 volumes of 8^3.
fn check(config: &Config, run: impl FnOnce(&Training<UNet3d>)) {
    let data = SyntheticVolumes::new(8, 4);
    let build = || UNet3d::new(config.clone(), &Device::Cpu, 3).unwrap();
    let inputs = |model: &UNet3d, step: u64| {
        let (x, y) = data.batch(step, 2);
        model.inputs(&x, &y, 8, &Device::Cpu).unwrap()
    };
    let optimizer = trainable::OptimizerKind::Adamw;
    run(&Training { build: &build, inputs: &inputs, optimizer, lr: 1e-3, seed: 1 })
}

#[test]
fn gradients_and_batchnorm_statistics_equal_off_bit_for_bit() {
    // Mixed precision too, so bf16 and f16 are checked on a model with BatchNorm, not only GPT-2.
    let half =
        [trainable::Precision::Bf16, trainable::Precision::F16, trainable::Precision::Bf16Weights]
            .map(|dtype| Config { dtype, ..tiny() });
    let policies = [
        "sqrt",
        "every-two-blocks",
        "before-downsample",
        "every-n=1",
        "before-downsample+keep=conv",
    ];
    for config in
        [tiny(), Config { loss: Loss::CrossEntropyDice, ..tiny() }].into_iter().chain(half)
    {
        check(&config, |t| {
            assert!(!t.trace("off", Control::None).buffers.is_empty());
            t.assert_policies_equal_off(&policies, &format!("{:?}", config.dtype));
        });
    }
}

/// Negative control: without the recompute flag BatchNorm updates its statistics twice under
/// every policy that recomputes a BatchNorm stage, and the check above sees it.
#[test]
fn without_the_recompute_flag_the_statistics_differ() {
    for policy in ["sqrt", "before-downsample"] {
        check(&tiny(), |t| t.assert_control_breaks(policy, Control::NoRecomputeFlag));
    }
}

#[test]
fn every_parameter_receives_a_nonzero_gradient() {
    let policies = ["off", "sqrt", "before-downsample"];
    check(&tiny(), |t| t.assert_every_parameter_learns(&policies, "f32"));
}

#[test]
fn before_downsample_stores_exactly_the_skip_tensors() {
    let model = UNet3d::new(tiny(), &Device::Cpu, 0).unwrap();
    let exec =
        Executor::new(model.graph(), &Policy::BeforeDownsample, model.params().vars(), 0).unwrap();
    let g = model.graph();
    let skips: Vec<usize> =
        g.downsampling_stages().iter().map(|&pool| g.nodes()[pool].inputs[0]).collect();
    assert_eq!(exec.stored_values(), skips);
    let names: Vec<String> =
        skips.iter().map(|&v| g.nodes()[g.producer(v).unwrap()].stage.name()).collect();
    assert_eq!(names, ["enc.0", "enc.1"]);
}

#[test]
fn presets_have_the_paper_widths() {
    let model = UNet3d::new(unet3d::Preset::Cicek.config(), &Device::Cpu, 0).unwrap();
    let width = |name: &str| {
        model.params().named().find(|(n, _)| *n == name).map(|(_, v)| v.dims()[0]).unwrap()
    };
    let widths: Vec<usize> = [
        "enc.0.conv1.weight",
        "enc.1.conv1.weight",
        "enc.2.conv1.weight",
        "bottom.conv1.weight",
        "bottom.conv2.weight",
    ]
    .iter()
    .map(|n| width(n))
    .collect();
    assert_eq!(widths, [32, 64, 128, 256, 512]);
    assert!("big".parse::<unet3d::Preset>().unwrap_err().to_string().contains("cicek"));
}

#[test]
fn own_snapshot_round_trips_into_a_freshly_seeded_model() {
    let side = 8;
    let saved = UNet3d::new(tiny(), &Device::Cpu, 1).unwrap();
    // A training step moves the BatchNorm statistics off their initial values, which every seed
    // shares.
    let exec = Executor::new(saved.graph(), &Policy::Off, saved.params().vars(), 0).unwrap();
    let (x, y) = SyntheticVolumes::new(side, 4).batch(0, 2);
    let inputs = saved.inputs(&x, &y, side, &Device::Cpu).unwrap();
    exec.step(&inputs, 0).unwrap();
    let logits = |m: &UNet3d| {
        m.logits(&inputs[0], remat::RunMode::Eval)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let fresh = UNet3d::new(tiny(), &Device::Cpu, 2).unwrap();
    testkit::assert_snapshot_round_trip(
        &saved,
        &fresh,
        UNet3d::params,
        logits,
        UNet3d::load_snapshot,
    );
}
