//! BERT (masked LM) against Hugging Face `transformers` (`tests/fixtures/bert.safetensors`, written
//! by `scripts/make_fixtures.py`): a tiny model's MLM logits, the masked-LM loss and every
//! parameter's gradient, under `off` and `sqrt`, on a batch with random token types and a padded
//! row; and the same under `peft`'s LoRA (`bert-lora`: the adapter loaded from PEFT's own files,
//! the adapters' gradients). Tolerances: `testkit::reference`.

use anyhow::{Context, Result};
use bert::{Bert, MaskedBatch};
use candle_core::Device;
use std::path::Path;
use testkit::reference::{check_close, check_training_step, on_both_routes, Fixture, LOGITS_TOL};
use trainable::Model;

/// On the CPU kernels and on the device-generic route a GPU takes (`Path::Generic`); the only test
/// in its binary, as the route is process-wide.
#[test]
fn logits_loss_and_gradients_match_pytorch() -> Result<()> {
    on_both_routes(against_pytorch)
}

fn against_pytorch() -> Result<()> {
    for name in ["bert", "bert-lora"] {
        against_fixture(name).with_context(|| format!("fixture {name}"))?;
    }
    Ok(())
}

fn against_fixture(name: &str) -> Result<()> {
    let fx = Fixture::load(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/{name}.safetensors")),
    )?;
    let model = Bert::new(bert::Config { lora: fx.lora()?, ..fx.config()? }, &Device::Cpu, 0)?;
    fx.load_into(&model)?;
    let (b, t) = fx.tensor("ids")?.dims2()?;
    let attention_mask: Vec<f32> =
        fx.ids("attention_mask")?.into_iter().map(|m| m as f32).collect();
    assert!(
        attention_mask.contains(&0.0) && fx.ids("token_types")?.contains(&1),
        "the fixture exercises padding and segment B"
    );
    let batch = MaskedBatch {
        batch: b,
        seq: t,
        input_ids: fx.ids("ids")?,
        token_types: fx.ids("token_types")?,
        attention_mask,
        labels: fx.ids("labels")?,
        weights: fx.f32s("weights")?,
    };
    let inputs = model.inputs(&batch, &Device::Cpu)?;
    let hidden = model.hidden_states(
        &inputs[0],
        Some(&inputs[1]),
        Some(&inputs[2]),
        remat::RunMode::Eval,
    )?;
    check_close(
        "logits",
        &model.logits(&hidden, remat::RunMode::Eval)?,
        &fx.tensor("logits")?,
        LOGITS_TOL,
    )?;
    for policy in ["off", "sqrt"] {
        let worst = check_training_step(&fx, model.graph(), model.params(), &inputs, policy)?;
        eprintln!("{policy}: largest gradient error {worst:.2e}");
    }
    Ok(())
}
