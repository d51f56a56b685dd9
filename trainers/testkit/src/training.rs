//! What a training feature must keep exact, checked the same way for every model: freezing,
//! LoRA (its gradients, its files, its merge), the optimizer inside backward, snapshots that load
//! back bit for bit.

use crate::memory::second_step_peaks;
use candle_core::Device;
use remat::Executor;
use std::path::Path;

/// Freezing costs the trained parameters nothing and the frozen ones everything: `frozen` is
/// `config` with some parameters frozen (`--freeze`). Under every policy, a step of the frozen
/// model stores gradients of its trained parameters only, every one non-zero and bit-identical
/// to `off`'s and to the same parameter's gradient in the model with nothing frozen (freezing
/// changes no value, only what is computed).
pub fn assert_frozen_parameters_get_no_gradient<M: trainable::Benchable>(
    config: &M::Config,
    frozen: &M::Config,
    size: usize,
    batch: usize,
) {
    let (all, part) =
        (M::build(config, &Device::Cpu, 0).unwrap(), M::build(frozen, &Device::Cpu, 0).unwrap());
    let inputs = all
        .synthetic_inputs(&all.synthetic_data(size, 0).unwrap(), 0, batch, &Device::Cpu)
        .unwrap();
    let step = |model: &M, policy: &str| {
        let exec = Executor::new(
            model.graph(),
            &policy.parse::<remat::Policy>().unwrap(),
            model.params().vars(),
            7,
        )
        .unwrap();
        exec.step(&inputs, 0).unwrap().grads
    };
    let frozen_names: Vec<&str> = part.params().frozen().map(|(name, _)| name).collect();
    assert!(!frozen_names.is_empty(), "nothing frozen");
    let trained = part.params().vars();
    assert_eq!(
        trained.len() + frozen_names.len(),
        all.params().vars().len(),
        "every parameter trains or is frozen"
    );
    let reference = all.params().grad_bits(&step(&all, "off")).unwrap();
    let mut policies = vec!["off", "sqrt", "every-two-blocks"];
    if M::DOWNSAMPLES {
        policies.push("before-downsample");
    }
    for policy in policies {
        let grads = step(&part, policy);
        assert_eq!(
            grads.get_ids().count(),
            trained.len(),
            "{policy}: gradients stored beyond the trained parameters'"
        );
        let bits = part.params().grad_bits(&grads).unwrap();
        assert_eq!(bits.len(), trained.len(), "{policy}: a trained parameter got no gradient");
        for (name, bits) in bits {
            assert!(bits.iter().any(|&b| b << 1 != 0), "{policy}: {name} got a zero gradient");
            assert!(
                bits == reference[&name],
                "{policy}: {name}'s gradient differs from the unfrozen model's under off"
            );
        }
    }
    eprintln!(
        "{} of {} parameters frozen; the rest's gradients equal the unfrozen model's under every \
         policy",
        frozen_names.len(),
        all.params().vars().len()
    );
}

/// LoRA trains its adapters and nothing else, exactly and cheaply: `config` has adapters, with B
/// drawn (`init_lora_weights: false`: from B = 0, A's gradient is zero). With dropout on, a step
/// under every policy stores gradients for the adapters alone, each non-zero and equal bit for bit
/// to plain candle's (the whole graph, one `backward()`); and its peak stays below full
/// fine-tuning's (`full`: the same model without adapters) by at least half the base weights'
/// gradients, which LoRA neither computes nor stores (a weight-dominated size: where activations
/// dominate, the peak falls before any gradient exists).
pub fn assert_lora_trains_adapters_only<M: trainable::Benchable>(
    config: &M::Config,
    full: &M::Config,
    size: usize,
    batch: usize,
) {
    let lora = M::build(config, &Device::Cpu, 0).unwrap();
    let adapters = lora.params().vars();
    assert!(
        !adapters.is_empty() && lora.params().named().all(|(n, _)| params::lora::is_adapter(n)),
        "LoRA must train the adapters alone"
    );
    let data = lora.synthetic_data(size, 0).unwrap();
    let inputs = |step: u64| lora.synthetic_inputs(&data, step, batch, &Device::Cpu).unwrap();
    let plain = lora.graph().plain_loss(&inputs(0), 7, 0).unwrap().backward().unwrap();
    assert_eq!(
        plain.get_ids().count(),
        adapters.len(),
        "plain candle stored gradients beyond the adapters'"
    );
    let reference = lora.params().grad_bits(&plain).unwrap();
    // `+keep=matmul`: an adapted layer's output replayed in the recompute, with the adapter's
    // backward.
    let mut policies = vec!["off", "sqrt", "every-two-blocks", "sqrt+keep=matmul"];
    if M::DOWNSAMPLES {
        policies.push("before-downsample");
    }
    for policy in policies {
        let exec = Executor::new(
            lora.graph(),
            &policy.parse::<remat::Policy>().unwrap(),
            adapters.clone(),
            7,
        )
        .unwrap();
        let grads = exec.step(&inputs(0), 0).unwrap().grads;
        assert_eq!(
            grads.get_ids().count(),
            adapters.len(),
            "{policy}: gradients stored beyond the adapters'"
        );
        let bits = lora.params().grad_bits(&grads).unwrap();
        for (name, want) in &reference {
            assert!(want.iter().any(|&b| b << 1 != 0), "{name} got a zero gradient");
            assert!(
                bits.get(name) == Some(want),
                "{policy}: {name}'s gradient differs from plain candle's"
            );
        }
    }
    let peak = |model: &M| {
        let exec =
            Executor::new(model.graph(), &remat::Policy::Off, model.params().vars(), 7).unwrap();
        second_step_peaks(&exec, inputs).unwrap().step
    };
    let base = M::build(full, &Device::Cpu, 0).unwrap();
    let weight_grads: u64 = base
        .params()
        .vars()
        .iter()
        .map(|v| (v.elem_count() * v.dtype().size_in_bytes()) as u64)
        .sum();
    let (lora_peak, full_peak) = (peak(&lora), peak(&base));
    assert!(
        lora_peak + weight_grads / 2 <= full_peak,
        "LoRA's step peak {lora_peak} B, full fine-tuning's {full_peak} B: the base weights' \
         gradients ({weight_grads} B) were not all saved"
    );
    eprintln!(
        "{} adapters: gradients = plain candle's under every policy; step peak {lora_peak} B vs \
         full fine-tuning {full_peak} B",
        adapters.len()
    );
}

/// The optimizer inside backward (`--optimizer-in-backward`) on a model of `config` at `batch`
/// and input `size`, dropout on: after three steps under `off` and `sqrt` the weights equal the
/// ordinary step's bit for bit, for SGD, AdamW and Adafactor; and at no event of the three steps
/// (the first included) are more than half the gradients the ordinary step ends with held. With the
/// update after backward, as the ordinary step runs it, every gradient is held at the end: the
/// check fails.
pub fn assert_optimizer_in_backward<M: trainable::Benchable>(
    config: &M::Config,
    size: usize,
    batch: usize,
) {
    let group = trainkit::Group::single();
    for kind in [
        trainable::OptimizerKind::Sgd,
        trainable::OptimizerKind::Adamw,
        trainable::OptimizerKind::Adafactor,
    ] {
        for policy in ["off", "sqrt"] {
            let run = |in_backward: bool| {
                let model = M::build(config, &Device::Cpu, 0).unwrap();
                let vars = model.params().vars();
                let exec = Executor::new(
                    model.graph(),
                    &policy.parse::<remat::Policy>().unwrap(),
                    vars.clone(),
                    7,
                )
                .unwrap();
                let mut opt = kind.build(vars.clone(), kind.bench_lr()).unwrap();
                let data = model.synthetic_data(size, 0).unwrap();
                let stepper = trainkit::Stepper {
                    group: &group,
                    exec: &exec,
                    accumulate: 1,
                    in_backward,
                    batch_names: None,
                };
                let inputs = |n: u64| Ok(model.synthetic_inputs(&data, n, batch, &Device::Cpu)?);
                let mut held = 0;
                for step in 0..3 {
                    let out = stepper.step(step, None, inputs, opt.as_mut()).unwrap();
                    held = out.timeline.events.iter().map(|e| e.grad_bytes).fold(held, u64::max);
                }
                let weights: Vec<Vec<u32>> =
                    vars.iter().map(|v| params::f32_bits(v.as_tensor()).unwrap()).collect();
                (weights, held)
            };
            let ((ordinary, all), (inside, held)) = (run(false), run(true));
            assert!(
                inside == ordinary,
                "{kind} {policy}: the weights after the optimizer inside backward differ from the \
                 ordinary step's"
            );
            eprintln!(
                "{kind} {policy}: at most {held} B of gradients held inside backward, {all} B \
                 after it"
            );
            assert!(
                held * 2 <= all,
                "{kind} {policy}: {held} B of gradients held at once with the optimizer inside \
                 backward, of {all} B"
            );
        }
    }
}

/// A model's adapters leave it in PEFT's layout and come back exactly, and merge into the base:
/// `config` has the adapters `lora` (B drawn: `init_lora_weights: false`), `base` is the same
/// model without them. The adapter written
/// by [`params::lora::save_adapter`] holds the adapters alone under PEFT's keys
/// (`base_model.model.<published name>`) and loads into a model of another seed bit for bit;
/// [`params::ParamStore::merged`] loaded into the model without adapters evaluates as the adapted
/// model does, to f32 rounding, and changes every adapted weight.
pub fn assert_lora_files<M: trainable::Benchable>(
    config: &M::Config,
    base: &M::Config,
    lora: &params::lora::Lora,
    size: usize,
    batch: usize,
) {
    use params::lora::{is_adapter, save_adapter, PeftModel};
    let adapted = M::build(config, &Device::Cpu, 0).unwrap();
    let dir = std::env::temp_dir().join(format!("remat-lora-{}-{}", std::process::id(), size));
    let published = |n: &str| adapted.published_name(n);
    save_adapter(
        &dir,
        adapted.params(),
        lora,
        &PeftModel {
            base_model: "",
            task_type: None,
            fan_in_fan_out: false,
            published_name: &published,
        },
    )
    .unwrap();
    let (file, _) =
        params::read_snapshot(&dir.join("adapter_model.safetensors"), &Device::Cpu).unwrap();
    let adapters: Vec<(&str, &candle_core::Var)> = adapted.params().named().collect();
    assert_eq!(file.len(), adapters.len(), "the adapter file holds the adapters alone");
    for (name, _) in &adapters {
        assert!(
            file.contains_key(&format!("base_model.model.{}", adapted.published_name(name))),
            "{name} is not under PEFT's key"
        );
    }
    let saved = params::lora::read_adapter_config(&dir).unwrap();
    let mut targets = lora.targets.clone();
    targets.sort();
    assert_eq!(saved.lora, params::lora::Lora { targets, init_lora_weights: true, ..lora.clone() });

    let other = M::build(config, &Device::Cpu, 1).unwrap();
    other.load_adapter(&dir).unwrap();
    for ((name, a), (_, b)) in adapters.iter().zip(other.params().named()) {
        assert!(
            params::f32_bits(a).unwrap() == params::f32_bits(b).unwrap(),
            "{name} did not load back bit for bit"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();

    let merged = adapted.params().merged().unwrap();
    assert!(merged.keys().all(|n| !is_adapter(n)), "merged weights hold an adapter");
    let plain = M::build(base, &Device::Cpu, 5).unwrap();
    plain
        .params()
        .load_tensors(merged.clone(), "merged", |n| Some(n.to_string()), |_| false)
        .unwrap();
    let before = adapted.params().tensors();
    let changed = merged
        .iter()
        .filter(|(n, t)| params::f32_bits(t).unwrap() != params::f32_bits(&before[*n]).unwrap())
        .count();
    assert_eq!(
        changed,
        adapters.len() / 2,
        "merging must change each adapted weight, and nothing else"
    );
    let inputs = adapted
        .synthetic_inputs(&adapted.synthetic_data(size, 0).unwrap(), 0, batch, &Device::Cpu)
        .unwrap();
    let (want, got) = (adapted.evaluate(&inputs).unwrap(), plain.evaluate(&inputs).unwrap());
    assert!(
        ((got - want) / want).abs() < 1e-5,
        "merged weights evaluate to {got}, the adapted model to {want}"
    );
}

/// A snapshot of `saved` loaded into `fresh`, a model built from another seed: their evaluation
/// outputs (`eval`) and buffers (BatchNorm statistics: `saved`'s must have moved, e.g. by a
/// training step) differ before loading and are bit-identical after.
pub fn assert_snapshot_round_trip<M>(
    saved: &M,
    fresh: &M,
    store: impl Fn(&M) -> &params::ParamStore,
    eval: impl Fn(&M) -> Vec<f32>,
    load: impl Fn(&M, &Path) -> std::result::Result<(), params::SnapshotError>,
) {
    let dir = std::env::temp_dir().join(format!(
        "snapshot-round-trip-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("own.safetensors");
    store(saved).save(&path).unwrap();
    let buffers = |m: &M| store(m).buffer_bits().unwrap();
    assert_ne!(eval(fresh), eval(saved), "different seeds must give different models");
    let saved_buffers = buffers(saved);
    if !saved_buffers.is_empty() {
        assert!(
            saved_buffers != buffers(fresh),
            "the running statistics must have moved, or loading them proves nothing"
        );
    }
    load(fresh, &path).unwrap();
    assert_eq!(eval(fresh), eval(saved), "evaluation outputs differ after loading");
    assert!(buffers(fresh) == saved_buffers, "buffers differ after loading");
    std::fs::remove_dir_all(&dir).unwrap();
}
