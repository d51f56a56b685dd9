//! ResNet under checkpointing: gradients and BatchNorm statistics equal `off` bit for bit, every
//! parameter learns, memory falls, and the model loads torchvision-named weights and its own
//! snapshots.

use candle_core::{Device, Tensor};
use candle_nn::Optimizer;
use datasets::images::SyntheticImages;
use optim::{ParamsSgd, SgdMomentum};

use model::Model;
use remat::{Executor, Policy};
use resnet::{Config, ResNet};
use std::collections::BTreeMap;

type Bits = BTreeMap<String, Vec<u32>>;

fn tiny() -> Config {
    Config { classes: 4, ..resnet::Preset::Tiny.config() }
}

/// Two SGD steps of a tiny bottleneck ResNet: per step (loss bits, gradient bits), then the
/// BatchNorm running statistics at the end.
fn train(policy: &str, guard: bool) -> (Vec<(u32, Bits)>, Bits) {
    train_in(policy, guard, model::Precision::F32)
}

/// [`train`] with activations in `dtype`.
fn train_in(policy: &str, guard: bool, dtype: model::Precision) -> (Vec<(u32, Bits)>, Bits) {
    let (batch, size) = (4, 32);
    let model = ResNet::new(Config { dtype, ..tiny() }, &Device::Cpu, 11).unwrap();
    let mut exec =
        Executor::new(model.graph(), &policy.parse::<Policy>().unwrap(), model.params().vars(), 5)
            .unwrap();
    if !guard {
        exec = exec.without_recompute_flag();
    }
    let mut opt =
        SgdMomentum::new(model.params().vars(), ParamsSgd { lr: 0.05, ..Default::default() })
            .unwrap();
    let data = SyntheticImages::new(4, size, 2);
    let steps = (0..2u64)
        .map(|step| {
            let (x, y) = data.batch(step, batch);
            let out = exec.step(&model.inputs(&x, &y, size, &Device::Cpu).unwrap(), step).unwrap();
            opt.step(&out.grads).unwrap();
            (
                out.loss.to_scalar::<f32>().unwrap().to_bits(),
                model.params().grad_bits(&out.grads).unwrap(),
            )
        })
        .collect();
    (steps, model.params().buffer_bits().unwrap())
}

const POLICIES: [&str; 4] = ["sqrt", "every-two-blocks", "before-downsample", "sqrt+keep=conv"];

/// In bf16 and f16 too (parameters, gradients and running statistics f32, activations half), and
/// in bf16-weights (parameters and gradients bf16, running statistics f32),
/// every policy equals `off` bit for bit, and every parameter gets a non-zero gradient.
#[test]
fn gradients_and_statistics_equal_off_bit_for_bit_in_half_precision() {
    for dtype in [model::Precision::Bf16, model::Precision::F16, model::Precision::Bf16Weights] {
        let off = train_in("off", true, dtype);
        for (name, g) in &off.0[0].1 {
            assert!(
                g.iter().any(|&x| f32::from_bits(x) != 0.0),
                "{dtype}: `{name}` got a zero gradient"
            );
        }
        for policy in POLICIES {
            assert!(
                train_in(policy, true, dtype) == off,
                "{dtype} {policy}: losses, gradients or statistics differ from off"
            );
        }
    }
}

#[test]
fn gradients_and_batchnorm_statistics_equal_off_bit_for_bit() {
    let (off, off_stats) = train("off", true);
    assert!(off_stats.len() >= 2 * 10, "expected running mean and var of every BatchNorm");
    for policy in POLICIES {
        let (run, stats) = train(policy, true);
        for (step, (a, b)) in off.iter().zip(&run).enumerate() {
            assert_eq!(a.0, b.0, "{policy}: loss differs at step {step}");
            assert_eq!(a.1.keys().collect::<Vec<_>>(), b.1.keys().collect::<Vec<_>>(), "{policy}");
            for (name, g) in &a.1 {
                assert!(g == &b.1[name], "{policy}: gradient of {name} differs at step {step}");
            }
        }
        for (name, s) in &off_stats {
            assert!(s == &stats[name], "{policy}: {name} differs from off");
        }
    }
}

#[test]
fn without_the_recompute_guard_batchnorm_statistics_differ() {
    let (_, off_stats) = train("off", true);
    let (_, stats) = train("before-downsample", false);
    let differing: Vec<&String> = off_stats.keys().filter(|n| off_stats[*n] != stats[*n]).collect();
    assert!(
        !differing.is_empty(),
        "updating twice must change the running statistics, or the test cannot fail"
    );
}

#[test]
fn every_parameter_receives_a_nonzero_gradient() {
    let n = ResNet::new(tiny(), &Device::Cpu, 11).unwrap().params().vars().len();
    for policy in ["off", "sqrt", "every-two-blocks", "before-downsample"] {
        for (_, grads) in train(policy, true).0 {
            assert_eq!(grads.len(), n, "{policy}: some parameters got no gradient");
            for (name, g) in grads {
                assert!(
                    g.iter().any(|&b| f32::from_bits(b) != 0.0),
                    "{policy}: gradient of {name} is all zero"
                );
            }
        }
    }
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
