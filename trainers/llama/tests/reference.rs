//! The Llama family against Hugging Face `transformers` and `peft`
//! (`tests/fixtures/<architecture>[-lora].safetensors`, written by `scripts/make_fixtures.py`): a
//! tiny model of each of the four architectures, read from the `config.json` `transformers`
//! wrote (as `train-llama --config` reads it); its logits and evaluation loss, its training loss
//! and every parameter's gradient under `off` and `sqrt`; and the same under `peft`'s LoRA (the
//! adapter loaded from PEFT's own files, the adapters' gradients). Tolerances:
//! `testkit::reference`.

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use llama::{Config, Llama};
use std::path::Path;
use testkit::reference::{
    check_close, check_evaluation, check_training_step, on_both_routes, Fixture, LOGITS_TOL,
};
use trainable::Model;

/// On the CPU kernels and on the device-generic route a GPU takes; the only test in its binary,
/// as the route is process-wide.
#[test]
fn logits_loss_and_gradients_match_pytorch() -> Result<()> {
    on_both_routes(against_pytorch)
}

fn against_pytorch() -> Result<()> {
    for architecture in ["llama", "mistral", "qwen2", "qwen3"] {
        for name in [architecture.to_string(), format!("{architecture}-lora")] {
            against_fixture(&name).with_context(|| format!("fixture {name}"))?;
        }
    }
    Ok(())
}

fn against_fixture(name: &str) -> Result<()> {
    let fx = Fixture::load(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/{name}.safetensors")),
    )?;
    let json = fx.config::<serde_json::Value>()?.to_string();
    let config = Config::from_json_text(&json).map_err(anyhow::Error::msg)?;
    let model = Llama::new(Config { lora: fx.lora()?, ..config }, &Device::Cpu, 0)?;
    fx.load_into(&model)?;
    let (b, t) = fx.tensor("ids")?.dims2()?;
    let ids = Tensor::from_vec(fx.ids("ids")?, (b, t), &Device::Cpu)?;
    check_close(
        "logits",
        &model.logits(&ids, remat::RunMode::Eval)?,
        &fx.tensor("logits")?,
        LOGITS_TOL,
    )?;
    let inputs = model.inputs(&fx.ids("ids")?, &fx.ids("targets")?, b, t, &Device::Cpu)?;
    check_evaluation(&model, &inputs, &fx.tensor("logits")?, &fx.ids("targets")?)?;
    for policy in ["off", "sqrt"] {
        let worst = check_training_step(&fx, model.graph(), model.params(), &inputs, policy)?;
        eprintln!("{name} {policy}: largest gradient error {worst:.2e}");
    }
    Ok(())
}
