//! ResNet against torchvision (`tests/fixtures/resnet.safetensors`, written by
//! `scripts/make_fixtures.py` from torchvision's own `Bottleneck`): the `tiny` preset's evaluation
//! logits (random running statistics) and evaluation loss, then one training step under `off` and
//! `sqrt`: the loss with BatchNorm in training mode, every parameter's gradient and every running
//! statistic after the step. Tolerances: `testkit::reference`.

use anyhow::Result;
use candle_core::{Device, Tensor};
use resnet::{Config, ResNet};
use testkit::reference::{
    check_close, check_evaluation, check_training_step, on_both_routes, Fixture, LOGITS_TOL,
};
use trainable::Model;

#[derive(serde::Deserialize)]
struct FixtureConfig {
    preset: String,
    classes: usize,
    image_size: usize,
}

/// On the CPU kernels and on the device-generic route a GPU takes (`Path::Generic`); the only test
/// in its binary, as the route is process-wide.
#[test]
fn logits_loss_gradients_and_statistics_match_pytorch() -> Result<()> {
    on_both_routes(against_pytorch)
}

fn against_pytorch() -> Result<()> {
    let fx = Fixture::load(
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/resnet.safetensors").as_ref(),
    )?;
    let cfg: FixtureConfig = fx.config()?;
    let config = Config { classes: cfg.classes, ..cfg.preset.parse::<resnet::Preset>()?.config() };
    let model = ResNet::new(config, &Device::Cpu, 0)?;
    let images = fx.f32s("images")?;
    let labels = fx.ids("labels")?;
    let size = cfg.image_size;
    model.load_snapshot(fx.weights())?;
    let batch = Tensor::from_slice(&images, (labels.len(), 3, size, size), &Device::Cpu)?;
    check_close(
        "logits",
        &model.logits(&batch, remat::RunMode::Eval)?,
        &fx.tensor("logits")?,
        LOGITS_TOL,
    )?;
    check_evaluation(
        &model,
        &model.inputs(&images, &labels, size, &Device::Cpu)?,
        &fx.tensor("logits")?,
        &labels,
    )?;
    for policy in ["off", "sqrt"] {
        model.load_snapshot(fx.weights())?; // the running statistics as the reference started
        let inputs = model.inputs(&images, &labels, size, &Device::Cpu)?;
        let worst = check_training_step(&fx, model.graph(), model.params(), &inputs, policy)?;
        eprintln!("{policy}: largest gradient error {worst:.2e}");
    }
    Ok(())
}
