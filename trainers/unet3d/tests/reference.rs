//! The 3D U-Net against PyTorch (`tests/fixtures/unet3d-{batch,group}.safetensors`, written by
//! `scripts/make_fixtures.py` with `torch.nn.functional`'s conv3d, conv_transpose3d, max_pool3d,
//! batch_norm and group_norm): the `tiny` preset's evaluation logits, then one training step under
//! `off`, `sqrt` and `before-downsample`: the loss (BatchNorm with CE + soft Dice, GroupNorm with
//! CE), every parameter's gradient and every running statistic after the step. Tolerances:
//! `testkit::reference`.

use anyhow::Result;
use candle_core::{Device, Tensor};
use testkit::reference::{check_close, check_training_step, on_both_routes, Fixture, LOGITS_TOL};
use trainable::Model;
use unet3d::{Config, Loss, Norm, UNet3d};

#[derive(serde::Deserialize)]
struct FixtureConfig {
    preset: String,
    norm: String,
    groups: usize,
    loss: String,
    side: usize,
    batch: usize,
}

fn check(file: &str) -> Result<()> {
    let fx =
        Fixture::load(format!("{}/tests/fixtures/{file}", env!("CARGO_MANIFEST_DIR")).as_ref())?;
    let cfg: FixtureConfig = fx.config()?;
    let config = Config {
        norm: if cfg.norm == "batch" { Norm::Batch } else { Norm::Group(cfg.groups) },
        loss: if cfg.loss == "ce" { Loss::CrossEntropy } else { Loss::CrossEntropyDice },
        ..cfg.preset.parse::<unet3d::Preset>()?.config()
    };
    let model = UNet3d::new(config, &Device::Cpu, 0)?;
    let (volume, labels, side) = (fx.f32s("volume")?, fx.ids("labels")?, cfg.side);
    model.load_snapshot(fx.weights())?;
    let batch = Tensor::from_slice(&volume, (cfg.batch, 1, side, side, side), &Device::Cpu)?;
    check_close(
        &format!("{file}: logits"),
        &model.logits(&batch, remat::RunMode::Eval)?,
        &fx.tensor("logits")?,
        LOGITS_TOL,
    )?;
    for policy in ["off", "sqrt", "before-downsample"] {
        model.load_snapshot(fx.weights())?; // the running statistics as the reference started
        let inputs = model.inputs(&volume, &labels, side, &Device::Cpu)?;
        let worst = check_training_step(&fx, model.graph(), model.params(), &inputs, policy)?;
        eprintln!("{file} {policy}: largest gradient error {worst:.2e}");
    }
    Ok(())
}

/// Both models, on the CPU kernels and on the device-generic route a GPU takes (`Path::Generic`);
/// one test, as the route is process-wide.
#[test]
fn batchnorm_with_dice_and_groupnorm_models_match_pytorch() -> Result<()> {
    on_both_routes(|| {
        check("unet3d-batch.safetensors").and_then(|()| check("unet3d-group.safetensors"))
    })
}
