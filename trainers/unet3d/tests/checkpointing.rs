//! The 3D U-Net under checkpointing: its skip edges cross segments, and BatchNorm runs in every
//! level; gradients and running statistics still equal `off` bit for bit; its snapshots load back.

use candle_core::Device;
use candle_nn::Optimizer;
use datasets::volumes::SyntheticVolumes;
use model::Model;
use optim::{AdamW, ParamsAdamW};
use remat::{Executor, Policy};
use std::collections::BTreeMap;
use unet3d::{Config, Loss, UNet3d};

type Bits = BTreeMap<String, Vec<u32>>;

fn tiny() -> Config {
    unet3d::Preset::Tiny.config()
}

fn train(config: &Config, policy: &str) -> (Vec<(u32, Bits)>, Bits) {
    train_guarded(config, policy, true)
}

/// Two AdamW steps; `guard: false` hides the recompute flag from the stages (BatchNorm then
/// updates its statistics on recompute too).
fn train_guarded(config: &Config, policy: &str, guard: bool) -> (Vec<(u32, Bits)>, Bits) {
    let side = 8;
    let model = UNet3d::new(config.clone(), &Device::Cpu, 3).unwrap();
    let mut exec =
        Executor::new(model.graph(), &policy.parse::<Policy>().unwrap(), model.params().vars(), 1)
            .unwrap();
    if !guard {
        exec = exec.without_recompute_flag();
    }
    let mut opt =
        AdamW::new(model.params().vars(), ParamsAdamW { lr: 1e-3, ..Default::default() }).unwrap();
    let data = SyntheticVolumes::new(side, 4);
    let steps = (0..2u64)
        .map(|step| {
            let (x, y) = data.batch(step, 2);
            let out = exec.step(&model.inputs(&x, &y, side, &Device::Cpu).unwrap(), step).unwrap();
            opt.step(&out.grads).unwrap();
            (
                out.loss
                    .to_dtype(candle_core::DType::F32)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
                    .to_bits(),
                model.params().grad_bits(&out.grads).unwrap(),
            )
        })
        .collect();
    (steps, model.params().buffer_bits().unwrap())
}

#[test]
fn gradients_and_batchnorm_statistics_equal_off_bit_for_bit() {
    // Mixed precision too, so bf16 and f16 are checked on a model with BatchNorm, not only GPT-2.
    let half = [model::Precision::Bf16, model::Precision::F16, model::Precision::Bf16Weights]
        .map(|dtype| Config { dtype, ..tiny() });
    for config in
        [tiny(), Config { loss: Loss::CrossEntropyDice, ..tiny() }].into_iter().chain(half)
    {
        let (off, off_stats) = train(&config, "off");
        assert!(!off_stats.is_empty());
        for policy in [
            "sqrt",
            "every-two-blocks",
            "before-downsample",
            "every-n=1",
            "before-downsample+keep=conv",
        ] {
            let (run, stats) = train(&config, policy);
            for (step, (a, b)) in off.iter().zip(&run).enumerate() {
                assert_eq!(a.0, b.0, "{policy}: loss differs at step {step}");
                assert_eq!(a.1.len(), b.1.len(), "{policy}");
                for (name, g) in &a.1 {
                    assert!(
                        g == &b.1[name],
                        "{policy} ({:?}): gradient of {name} differs at step {step}",
                        config.dtype
                    );
                }
            }
            assert!(off_stats == stats, "{policy}: BatchNorm running statistics differ from off");
        }
    }
}

/// Negative control: without the recompute flag BatchNorm updates its statistics twice under
/// every policy that recomputes a BatchNorm stage, and the check above sees it.
#[test]
fn without_the_recompute_flag_the_statistics_differ() {
    let off_stats = train(&tiny(), "off").1;
    for policy in ["sqrt", "before-downsample"] {
        assert!(
            train_guarded(&tiny(), policy, false).1 != off_stats,
            "{policy}: the check cannot fail"
        );
    }
}

#[test]
fn every_parameter_receives_a_nonzero_gradient() {
    let n = UNet3d::new(tiny(), &Device::Cpu, 3).unwrap().params().vars().len();
    for policy in ["off", "sqrt", "before-downsample"] {
        for (_, grads) in train(&tiny(), policy).0 {
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
