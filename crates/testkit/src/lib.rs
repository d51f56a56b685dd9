//! `testkit`: what the tests of the trainers and the harness share, and nothing the product
//! needs: the PyTorch reference fixtures ([`reference`]), memory checks of a training step,
//! running a trainer binary and reading its log, and checking that the documentation's command
//! lines still parse. A dev-dependency only.

pub mod reference;

use anyhow::Result;
use candle_core::{Device, Tensor};
use remat::memory::Meter;
use remat::plan::Grads;
use remat::Executor;
use std::path::Path;
use trainkit::read_losses;

/// Heap peaks of one training step (forward and backward), in bytes above the heap before it.
#[derive(Clone, Copy, Debug)]
pub struct Peaks {
    /// The highest heap during the step.
    pub step: u64,
    /// The same less the parameter gradients held at that point: what checkpointing acts on
    /// (`remat::memory::Timeline::activation_peak`).
    pub activation: u64,
    /// The heap when the forward pass ended (the last stage's output computed).
    pub forward_end: u64,
    /// The highest heap during backward (recomputes included).
    pub backward: u64,
    /// Bytes of the parameter gradients at the end of the step.
    pub grads: u64,
}

/// The peaks of the second of two steps under `exec` (the first pays one-off allocations such
/// as per-thread buffers). Needs [`remat::memory::CountingAlloc`] as the global allocator.
pub fn second_step_peaks(exec: &Executor, inputs: impl Fn(u64) -> Vec<Tensor>) -> Result<Peaks> {
    ops::allocate_matmul_workspaces();
    let mut peaks = Peaks { step: 0, activation: 0, forward_end: 0, backward: 0, grads: 0 };
    for step in 0..2 {
        let inputs = inputs(step);
        let meter = Meter::start(inputs[0].device());
        let out = exec.step(&inputs, step)?;
        let usage = meter.finish();
        let events = &out.timeline.events;
        let forward =
            events.iter().take_while(|e| e.phase == remat::memory::Phase::Forward).count();
        let above = |b: u64| b.saturating_sub(usage.heap_base);
        peaks = Peaks {
            step: usage.heap_peak_delta,
            activation: out.timeline.activation_peak(usage.heap_base),
            forward_end: events[..forward].last().map_or(0, |e| above(e.bytes)),
            backward: events[forward..].iter().map(|e| above(e.window_peak)).max().unwrap_or(0),
            grads: events.last().map_or(0, |e| e.grad_bytes),
        };
    }
    Ok(peaks)
}

/// Fails unless a measured figure is within 10 % of the one committed with a test: a memory
/// regression fails it, and so does an improvement, whose change must then update the figure.
pub fn assert_near_figure(what: &str, measured: u64, committed: u64) {
    let ratio = measured as f64 / committed as f64;
    eprintln!("{what}: {measured} B measured, {committed} B committed ({ratio:.3}x)");
    assert!(
        (0.9..=1.1).contains(&ratio),
        "{what}: measured {measured} B is {ratio:.3}x the committed {committed} B (allowed 0.9-1.1)"
    );
}

/// The memory checks of a deep transformer, given its peaks under a policy: `sqrt` at least
/// halves the step peak, the activation peaks of `off` and `sqrt` are the committed figures, and
/// under `off` the heap during backward stays within the end-of-forward level plus the parameter
/// gradients plus 5 %: the gradients in flight (the executor frees each stage once its gradients
/// are propagated). A backward that kept gradients it no longer needs exceeds it: with the
/// dropout masks' gradients kept, as candle does for a composed dropout, it is 40-60 %.
/// `off_forward_end` is what `off` holds at the end of forward as the model's shapes give it (the
/// test derives it): the measurement must be within 5 % of it.
pub fn assert_deep_model_memory(
    peaks: impl Fn(&str) -> Peaks,
    off_forward_end: u64,
    off_activation: u64,
    sqrt_activation: u64,
) {
    assert!(remat::memory::heap_meter_installed());
    let (off, sqrt) = (peaks("off"), peaks("sqrt"));
    let ratio = off.forward_end as f64 / off_forward_end as f64;
    eprintln!(
        "off: forward ends at {} B, {off_forward_end} B from the shapes ({ratio:.3}x)",
        off.forward_end
    );
    assert!(
        (0.95..=1.05).contains(&ratio),
        "off: forward ends at {} B, {ratio:.3}x the {off_forward_end} B the shapes give",
        off.forward_end
    );
    // The executor's backward frees each stage once its gradients are propagated: the heap during
    // backward stays within the end-of-forward level plus the parameter gradients plus 5 %.
    let bound = off.forward_end + off.grads + off.forward_end * 5 / 100;
    eprintln!(
        "off: forward ends at {} B, backward peaks at {} B, gradients {} B",
        off.forward_end, off.backward, off.grads
    );
    assert!(
        off.backward <= bound,
        "off: backward peaks at {} B, above the end of forward {} B + gradients {} B + 5 %",
        off.backward,
        off.forward_end,
        off.grads
    );
    eprintln!(
        "step peak: off {} B, sqrt {} B ({:.2}x)",
        off.step,
        sqrt.step,
        sqrt.step as f64 / off.step as f64
    );
    assert!(
        sqrt.step * 2 <= off.step,
        "sqrt peak {} B is more than half of off {} B",
        sqrt.step,
        off.step
    );
    assert_near_figure("off activation peak", off.activation, off_activation);
    assert_near_figure("sqrt activation peak", sqrt.activation, sqrt_activation);
}

/// Selective recompute holds what it keeps and no more: the activation peak of `policy` with
/// `+keep=` `keep` lies above `policy`'s by at least half of `kept` (the bytes of the outputs its
/// recomputed segments keep, from the shapes; the two peaks may fall at different points) and by at
/// most `kept` plus 5 % (a replayed output takes the place of a recomputed one), and below `off`'s.
/// Without the keeping (`keep` ignored), the first bound fails. Needs the counting allocator.
pub fn assert_keeping_holds_the_kept_outputs(
    peaks: impl Fn(&str) -> Peaks,
    policy: &str,
    keep: &str,
    kept: u64,
) {
    let keeping = format!("{policy}+keep={keep}");
    let (cut, with_kept, off) =
        (peaks(policy).activation, peaks(&keeping).activation, peaks("off").activation);
    eprintln!(
        "activation peaks: {policy} {cut} B, {keeping} {with_kept} B, off {off} B; kept from the \
         shapes {kept} B"
    );
    assert!(
        with_kept >= cut + kept / 2,
        "{keeping}: activation peak {with_kept} B, not half the {kept} B kept above {policy}'s \
         {cut} B"
    );
    assert!(
        with_kept <= cut + kept + kept / 20,
        "{keeping}: activation peak {with_kept} B holds more than the {kept} B kept above \
         {policy}'s {cut} B"
    );
    assert!(with_kept < off, "{keeping}: activation peak {with_kept} B is not below off's {off} B");
}

/// The planner's profile with alike stages measured once ([`remat::plan::Profile::measure`])
/// against every stage measured ([`remat::plan::Profile::measure_each`]), for a model of `config`
/// at `batch` and input `size`: at least `min_alike` stages are alike to an earlier one (a model
/// that lost its signatures fails here), the values and parameter gradients are the same bytes,
/// and every policy's predicted step peak agrees within 1 %. Needs the counting allocator.
pub fn assert_alike_stages_predict_as_measured<M: model::Benchable>(
    config: &M::Config,
    size: usize,
    batch: usize,
    min_alike: usize,
) {
    use remat::plan::Profile;
    use std::time::Instant;
    assert!(remat::memory::heap_meter_installed());
    let model = M::build(config, &Device::Cpu, 0).unwrap();
    let inputs = model
        .synthetic_inputs(&model.synthetic_data(size, 0).unwrap(), 0, batch, &Device::Cpu)
        .unwrap();
    let vars = model.params().vars();
    let mut seen = std::collections::HashSet::new();
    let alike = model
        .graph()
        .nodes()
        .iter()
        .filter_map(|n| n.stage.signature())
        .filter(|s| !seen.insert(s.clone()))
        .count();
    assert!(
        alike >= min_alike,
        "{alike} stages alike to an earlier one, expected at least {min_alike}"
    );
    let timed = |f: &dyn Fn() -> remat::Result<Profile>| {
        f().unwrap(); // the first pass pays the workspaces a process keeps
        let start = Instant::now();
        (f().unwrap(), start.elapsed())
    };
    let (reused, reused_time) =
        timed(&|| Profile::measure(model.graph(), &inputs, &vars, batch, 0));
    let (each, each_time) =
        timed(&|| Profile::measure_each(model.graph(), &inputs, &vars, batch, 0));
    eprintln!(
        "{alike} stages alike: profiled in {reused_time:?}, every stage measured in {each_time:?}"
    );
    assert_eq!(reused.values, each.values, "the values' bytes");
    assert_eq!(
        reused.param_grad_bytes(),
        each.param_grad_bytes(),
        "the parameter gradients' bytes"
    );
    let mut policies = vec!["off", "sqrt", "every-two-blocks"];
    if M::DOWNSAMPLES {
        policies.push("before-downsample");
    }
    for policy in policies {
        let policy: remat::Policy = policy.parse().unwrap();
        let (r, e) = (
            reused.predict_policy(&policy, Grads::Gathered).unwrap().peak,
            each.predict_policy(&policy, Grads::Gathered).unwrap().peak,
        );
        let error = r as f64 / e as f64 - 1.0;
        eprintln!(
            "{policy}: {r} B with alike stages reused, {e} B with every stage measured ({:+.2}%)",
            error * 100.0
        );
        assert!(
            error.abs() <= 0.01,
            "{policy}: {r} B predicted reusing alike stages, {e} B measuring each"
        );
    }
}

/// Freezing costs the trained parameters nothing and the frozen ones everything: `frozen` is
/// `config` with some parameters frozen (`--freeze`). Under every policy, a step of the frozen
/// model stores gradients of its trained parameters only, every one non-zero and bit-identical
/// to `off`'s and to the same parameter's gradient in the model with nothing frozen (freezing
/// changes no value, only what is computed).
pub fn assert_frozen_parameters_get_no_gradient<M: model::Benchable>(
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
pub fn assert_lora_trains_adapters_only<M: model::Benchable>(
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
pub fn assert_optimizer_in_backward<M: model::Benchable>(
    config: &M::Config,
    size: usize,
    batch: usize,
) {
    let group = trainkit::Group::single();
    for kind in
        [model::OptimizerKind::Sgd, model::OptimizerKind::Adamw, model::OptimizerKind::Adafactor]
    {
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
pub fn assert_lora_files<M: model::Benchable>(
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

/// `cmd` with its standard output on a full device (`/dev/full`) ends with exit 1, naming the
/// stream: what a run prints is its work, and a run whose output is lost has not done it.
pub fn assert_fails_on_a_full_stdout(cmd: &mut std::process::Command) {
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let out = cmd.stdout(full).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(1) && err.contains("writing to standard output"),
        "{:?}: {err}",
        out.status
    );
}

/// Runs the trainer binary `bin` with `args` and `--log-json`; it must succeed. Returns the
/// per-step training losses and what it printed on stderr.
pub fn run_logged(bin: &str, args: &[&str]) -> (Vec<f32>, String) {
    let log = std::env::temp_dir().join(format!(
        "run-logged-{}-{:x}.jsonl",
        std::process::id(),
        args_hash(args)
    ));
    let out = std::process::Command::new(bin)
        .args(args)
        .args(["--log-json", log.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{bin} {args:?}: {err}");
    let losses = read_losses(&log).unwrap();
    std::fs::remove_file(&log).unwrap();
    (losses, err)
}

/// A name for `args` (tests of one binary run in parallel, each with its own files).
fn args_hash(args: &[&str]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    args.hash(&mut h);
    h.finish()
}

/// Fails unless the mean of the last five losses is below the mean of the first five by `margin`.
pub fn assert_loss_falls(losses: &[f32], margin: f32, what: &str) {
    let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
    let (first, last) = (mean(&losses[..5]), mean(&losses[losses.len() - 5..]));
    assert!(
        last < first - margin,
        "{what}: the loss went from {first:.3} to {last:.3} (needs a fall of {margin}): {losses:?}"
    );
}

/// Runs the trainer binary `bin` (with its model and size flags `args`) for 4 steps straight, and
/// for 2 steps with a training snapshot followed by `--resume` to step 4: the per-step losses and
/// the final weights snapshot must be the same bits. Without a training snapshot, `--init` would
/// restart at step 0 with fresh optimizer state and its losses would differ from step 1 on.
pub fn assert_resume_is_bit_identical(bin: &str, args: &[&str]) {
    let name = Path::new(bin).file_name().unwrap().to_string_lossy().into_owned();
    let dir = std::env::temp_dir().join(format!(
        "resume-{name}-{}-{:x}",
        std::process::id(),
        args_hash(args)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(bin)
            .args(args)
            .args(["--policy", "sqrt"])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{bin} {args:?} {extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&[
        "--steps",
        "4",
        "--save",
        &path("straight.safetensors"),
        "--log-json",
        &path("straight.json"),
    ]);
    run(&[
        "--steps",
        "2",
        "--save",
        &path("cut.safetensors"),
        "--save-every",
        "2",
        "--log-json",
        &path("cut.json"),
    ]);
    run(&[
        "--steps",
        "4",
        "--save",
        &path("cut.safetensors"),
        "--resume",
        &path("cut.train.safetensors"),
        "--log-json",
        &path("cut.json"),
    ]);
    let losses = |name: &str| {
        read_losses(&dir.join(name)).unwrap().into_iter().map(f32::to_bits).collect::<Vec<_>>()
    };
    assert_eq!(losses("straight.json").len(), 4);
    assert_eq!(losses("cut.json"), losses("straight.json"), "losses of the resumed run");
    let weights = |name: &str| -> std::collections::BTreeMap<String, Vec<u32>> {
        candle_core::safetensors::load(dir.join(name), &Device::Cpu)
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, params::f32_bits(&t).unwrap()))
            .collect()
    };
    assert_eq!(
        weights("cut.safetensors"),
        weights("straight.safetensors"),
        "final weights of the resumed run"
    );
    // Snapshots are readable by all (0644, not 0600), as other tools write files.
    #[cfg(unix)]
    for name in ["cut.safetensors", "cut.train.safetensors"] {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(dir.join(name)).unwrap().permissions().mode() & 0o777,
            0o644,
            "{name}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// README.md and every page of docs/, one after the other: the documentation a user reads.
pub fn docs_text() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut pages = vec![root.join("README.md")];
    if let Ok(entries) = std::fs::read_dir(root.join("docs")) {
        let mut docs: Vec<_> = entries
            .filter_map(|e| Some(e.ok()?.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "md"))
            .collect();
        docs.sort();
        pages.extend(docs);
    }
    pages
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The command lines of README.md and docs/ that run the binary `bin` (`cargo run ... --bin
/// train-gpt2 -- ARGS`, `cargo run ... -p bench-harness -- ARGS`, `target/release/train-gpt2 ARGS`;
/// lines ending in `\` joined, `# comments` dropped): each one's ARGS, for a test to check that
/// they still parse.
pub fn readme_commands(bin: &str) -> Vec<Vec<String>> {
    let joined = docs_text().replace("\\\n", " ");
    let starts = [format!("--bin {bin} -- "), format!("target/release/{bin} ")];
    let mut commands = Vec::new();
    for line in joined.lines() {
        let line = line.split(" # ").next().unwrap_or("").trim();
        let harness = bin == "bench-harness"
            && line.starts_with("cargo run")
            && line.contains("-p bench-harness");
        let args = match starts.iter().find_map(|s| line.split_once(s.as_str())) {
            Some((_, args)) => args,
            None if harness => line.split_once(" -- ").map_or("", |(_, args)| args),
            None => continue,
        };
        // Up to the end of the command: a pipe, a redirection or the next command.
        commands.push(
            args.split_whitespace()
                .take_while(|w| {
                    !["&&", "||", "|", ";"].contains(w)
                        && !w.starts_with('>')
                        && !w.starts_with("2>")
                })
                .map(str::to_string)
                .collect(),
        );
    }
    commands
}

/// Fails unless every documented command line of `bin` ([`readme_commands`]; at least `at_least` of
/// them) still parses: run with `--help` last, which the parser answers only once every flag
/// before it exists and its value reads.
pub fn assert_readme_commands_parse(bin: &str, path: &str, at_least: usize) {
    let commands = readme_commands(bin);
    assert!(
        commands.len() >= at_least,
        "README.md and docs/ have {} command lines of {bin}, expected {at_least} or more",
        commands.len()
    );
    for args in commands {
        let out = std::process::Command::new(path).args(&args).arg("--help").output().unwrap();
        assert!(
            out.status.success(),
            "documented command {bin} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
