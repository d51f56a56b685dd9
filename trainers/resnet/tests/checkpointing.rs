//! ResNet under checkpointing: gradients and BatchNorm statistics equal `off` bit for bit, every
//! parameter learns, memory falls, and the model loads torchvision-named weights and its own
//! snapshots.

use candle_core::{Device, Tensor};
use datasets::images::SyntheticImages;
use remat::{Executor, Policy};
use resnet::{Config, ResNet};
use testkit::checkpointing::{Control, Training};
use trainable::Model;

fn tiny() -> Config {
    Config { classes: 4, ..resnet::Preset::Tiny.config() }
}

/// A tiny bottleneck ResNet, activations in `dtype`, trained with SGD on batches of 4 at 32x32.
fn check(dtype: trainable::Precision, run: impl FnOnce(&Training<ResNet>)) {
    let data = SyntheticImages::new(4, 32, 2);
    let build = || ResNet::new(Config { dtype, ..tiny() }, &Device::Cpu, 11).unwrap();
    let inputs = |model: &ResNet, step: u64| {
        let (x, y) = data.batch(step, 4);
        model.inputs(&x, &y, 32, &Device::Cpu).unwrap()
    };
    let optimizer = trainable::OptimizerKind::Sgd;
    run(&Training { build: &build, inputs: &inputs, optimizer, lr: 0.05, seed: 5 })
}

const POLICIES: [&str; 4] = ["sqrt", "every-two-blocks", "before-downsample", "sqrt+keep=conv"];

/// In bf16 and f16 too (parameters, gradients and running statistics f32, activations half), and
/// in bf16-weights (parameters and gradients bf16, running statistics f32), every policy equals
/// `off` bit for bit, and every parameter gets a non-zero gradient.
#[test]
fn gradients_and_statistics_equal_off_bit_for_bit_in_half_precision() {
    for dtype in
        [trainable::Precision::Bf16, trainable::Precision::F16, trainable::Precision::Bf16Weights]
    {
        check(dtype, |t| {
            t.assert_every_parameter_learns(&["off"], &dtype.to_string());
            t.assert_policies_equal_off(&POLICIES, &dtype.to_string());
        });
    }
}

#[test]
fn gradients_and_batchnorm_statistics_equal_off_bit_for_bit() {
    check(trainable::Precision::F32, |t| {
        let off = t.trace("off", Control::None);
        assert!(off.buffers.len() >= 2 * 10, "expected running mean and var of every BatchNorm");
        t.assert_policies_equal_off(&POLICIES, "f32");
    });
}

/// Updating twice must change the running statistics, or the test cannot fail.
#[test]
fn without_the_recompute_guard_batchnorm_statistics_differ() {
    check(trainable::Precision::F32, |t| {
        t.assert_control_breaks("before-downsample", Control::NoRecomputeFlag)
    });
}

#[test]
fn every_parameter_receives_a_nonzero_gradient() {
    let policies = ["off", "sqrt", "every-two-blocks", "before-downsample"];
    check(trainable::Precision::F32, |t| t.assert_every_parameter_learns(&policies, "f32"));
}

#[test]
fn parameter_shapes_from_the_configuration_match_the_model() {
    testkit::checkpointing::assert_parameter_shapes_match_the_model::<ResNet>(&tiny());
    let resnet18 = Config { classes: 10, ..resnet::Preset::Resnet18.config() };
    testkit::checkpointing::assert_parameter_shapes_match_the_model::<ResNet>(&resnet18);
}

#[test]
fn published_parameter_counts() {
    // torchvision's resnet18, resnet50, resnet152 (1000 classes), counted from the shapes...
    for (preset, count) in
        [("resnet18", 11_689_512), ("resnet50", 25_557_032), ("resnet152", 60_192_808)]
    {
        assert_eq!(
            preset.parse::<resnet::Preset>().unwrap().config().parameter_count(),
            count,
            "{preset}"
        );
    }
    // ...which are the parameters the model builds (checked where building is cheap).
    for preset in ["tiny", "resnet18"] {
        let config: Config = preset.parse::<resnet::Preset>().unwrap().config();
        assert_eq!(
            ResNet::new(config.clone(), &Device::Cpu, 0).unwrap().params().count(),
            config.parameter_count(),
            "{preset}"
        );
    }
    assert!("resnet51".parse::<resnet::Preset>().unwrap_err().to_string().contains("resnet50"));
}

#[test]
fn torchvision_snapshot_reproduces_the_logits() {
    let dir = std::env::temp_dir().join(format!("resnet-snapshot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let saved = ResNet::new(tiny(), &Device::Cpu, 1).unwrap();
    // Train a step so the running statistics are not at their initial values.
    let exec = Executor::new(saved.graph(), &Policy::Off, saved.params().vars(), 0).unwrap();
    let (x, y) = SyntheticImages::new(4, 32, 3).batch(0, 4);
    exec.step(&saved.inputs(&x, &y, 32, &Device::Cpu).unwrap(), 0).unwrap();
    let mut tensors: std::collections::HashMap<String, Tensor> = saved
        .params()
        .named()
        .chain(saved.params().buffers())
        .map(|(n, v)| (n.to_string(), v.as_tensor().clone()))
        .collect();
    tensors.insert("bn1.num_batches_tracked".into(), Tensor::new(1i64, &Device::Cpu).unwrap());
    let path = dir.join("resnet.safetensors");
    candle_core::safetensors::save(&tensors, &path).unwrap();

    let loaded = ResNet::new(tiny(), &Device::Cpu, 2).unwrap();
    loaded.load_snapshot(&path).unwrap();
    let images = saved.inputs(&x, &y, 32, &Device::Cpu).unwrap().remove(0);
    let want = saved
        .logits(&images, remat::RunMode::Eval)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(
        loaded
            .logits(&images, remat::RunMode::Eval)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap(),
        want
    );
    let wide = Tensor::zeros((4, 3, 32, 48), candle_core::DType::F32, &Device::Cpu).unwrap();
    assert!(loaded.logits(&wide, remat::RunMode::Eval).unwrap_err().to_string().contains("square"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn own_snapshot_round_trips_into_a_freshly_seeded_model() {
    let saved = ResNet::new(tiny(), &Device::Cpu, 1).unwrap();
    // A training step moves the BatchNorm statistics off their initial values, which every seed
    // shares.
    let exec = Executor::new(saved.graph(), &Policy::Off, saved.params().vars(), 0).unwrap();
    let (x, y) = SyntheticImages::new(4, 32, 3).batch(0, 4);
    let inputs = saved.inputs(&x, &y, 32, &Device::Cpu).unwrap();
    exec.step(&inputs, 0).unwrap();
    let logits = |m: &ResNet| {
        m.logits(&inputs[0], remat::RunMode::Eval)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let fresh = ResNet::new(tiny(), &Device::Cpu, 2).unwrap();
    testkit::assert_snapshot_round_trip(
        &saved,
        &fresh,
        ResNet::params,
        logits,
        ResNet::load_snapshot,
    );
}
