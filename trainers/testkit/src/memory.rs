//! Memory checks of a training step: the peaks of a step, measured figures held within 10 %,
//! a deep model's peaks under `off` and `sqrt`, selective recompute's kept bytes, the planner's
//! alike stages. Each needs the counting allocator as the test binary's global allocator.

use anyhow::Result;
use candle_core::{Device, Tensor};
use remat::memory::Meter;
use remat::plan::Grads;
use remat::Executor;

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
pub fn assert_alike_stages_predict_as_measured<M: trainable::Benchable>(
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
