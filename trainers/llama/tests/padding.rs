//! Padding is skipped: a batch of two examples of different lengths, right-padded to one length
//! with their padded targets `IGNORE`d (as `--packing lines` builds it), gives the logits at the
//! real positions, the loss and every parameter's gradient of the two examples run alone, each at
//! its own length (the loss the mean over their 13 real targets).

use candle_core::{Device, Result, Tensor};
use llama::{Architecture, Config, Llama};
use ops::fused::{cross_entropy, IGNORE};
use remat::RunMode;
use trainable::Model;

/// Logits of `ids` (B, T) and the mean cross-entropy against `targets`.
fn loss(model: &Llama, ids: &[u32], targets: &[u32], b: usize) -> Result<(Tensor, Tensor)> {
    let t = ids.len() / b;
    let logits = model.logits(&Tensor::from_slice(ids, (b, t), &Device::Cpu)?, RunMode::Eval)?;
    let targets = Tensor::from_slice(targets, b * t, &Device::Cpu)?;
    let loss = cross_entropy(&logits.flatten_to(1)?, &targets, None)?;
    Ok((logits, loss))
}

fn relative(a: &Tensor, b: &Tensor) -> Result<f32> {
    let scale = b.abs()?.max_all()?.to_scalar::<f32>()?.max(f32::MIN_POSITIVE);
    Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()? / scale)
}

#[test]
fn padded_batches_equal_their_examples_alone() -> Result<()> {
    for architecture in [Architecture::Llama, Architecture::Qwen2, Architecture::Qwen3] {
        let model = Llama::new(Config::tiny(architecture), &Device::Cpu, 3)?;
        let (a, b): (Vec<u32>, Vec<u32>) = ((1..=10).collect(), (40..46).collect());
        // (inputs, targets) of 9 and 5 pairs, padded to 12.
        let pad = |v: &[u32], with: u32| [v, &vec![with; 12 - v.len()]].concat();
        let ids = [pad(&a[..9], 0), pad(&b[..5], 0)].concat();
        let targets = [pad(&a[1..], IGNORE), pad(&b[1..], IGNORE)].concat();
        let (logits, padded) = loss(&model, &ids, &targets, 2)?;
        let (logits_a, loss_a) = loss(&model, &a[..9], &a[1..], 1)?;
        let (logits_b, loss_b) = loss(&model, &b[..5], &b[1..], 1)?;
        let what = format!("{architecture:?}");
        assert!(relative(&logits.get(0)?.narrow(0, 0, 9)?, &logits_a.get(0)?)? < 1e-5, "{what}");
        assert!(relative(&logits.get(1)?.narrow(0, 0, 5)?, &logits_b.get(0)?)? < 1e-5, "{what}");
        let alone = (((loss_a * 9.0)? + (loss_b * 5.0)?)? / 14.0)?;
        let e = relative(&padded, &alone)?;
        assert!(e < 1e-6, "{what}: the padded loss differs by {e:.1e}");
        let (grads, grads_alone) = (padded.backward()?, alone.backward()?);
        for (name, var) in model.params().named() {
            let (g, want) = (grads.get(var), grads_alone.get(var));
            let (g, want) = (g.expect(name), want.expect(name));
            let e = relative(g, want)?;
            assert!(e < 1e-5, "{what}: the gradient of {name} differs by {e:.1e}");
        }
    }
    Ok(())
}
