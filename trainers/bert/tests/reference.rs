//! BERT (masked LM) against Hugging Face `transformers` (`tests/fixtures/bert.safetensors`, written
//! by `scripts/make_fixtures.py`): a tiny model's MLM logits, the masked-LM loss and every
//! parameter's gradient, under `off` and `sqrt`. Tolerances: `trainkit::reference`.

use anyhow::Result;
use bert::{Bert, MaskedBatch};
use candle_core::{Device, Tensor};
use layers::Model;
use trainkit::reference::{check_close, check_training_step, Fixture, LOGITS_TOL};

#[test]
fn logits_loss_and_gradients_match_pytorch() -> Result<()> {
    let fx = Fixture::load(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/bert.safetensors").as_ref())?;
    let model = Bert::new(fx.config()?, &Device::Cpu, 0)?;
    model.load_snapshot(fx.path())?;
    let (b, t) = fx.tensor("ids")?.dims2()?;
    let ids = Tensor::from_vec(fx.ids("ids")?, (b, t), &Device::Cpu)?;
    check_close("logits", &model.logits(&ids)?, &fx.tensor("logits")?, LOGITS_TOL)?;
    let batch = MaskedBatch { input_ids: fx.ids("ids")?, labels: fx.ids("labels")?, weights: fx.f32s("weights")? };
    let inputs = model.inputs(&batch, b, t, &Device::Cpu)?;
    for policy in ["off", "sqrt"] {
        let worst = check_training_step(&fx, model.graph(), model.params(), &inputs, policy)?;
        eprintln!("{policy}: largest gradient error {worst:.2e}");
    }
    Ok(())
}
