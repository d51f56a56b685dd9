//! The guide's promise, on a model written with candle-nn and built against the published candle:
//! under `sqrt`, `every-n=2` and a `budget=` plan, with dropout on, the gradients equal plain
//! candle's (one `backward()` of the whole model) bit for bit, every parameter gets one, and the
//! measured step peak falls below `off`'s.

use candle_core::{backprop::GradStore, Device, Result};
use candle_nn::VarMap;
use remat::memory::{heap_current, heap_peak, reset_heap_peak, CountingAlloc};
use remat::plan::{Grads, Profile};
use remat::{Executor, Policy, PolicyRequest};
use small_transformer::{batch, new, Config};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const CFG: Config = Config { vocab: 96, context: 64, width: 64, heads: 4, layers: 8, dropout: 0.1 };

/// Every parameter's gradient bits, by name; fails on a parameter without one or with one of zeros.
fn bits(varmap: &VarMap, grads: &GradStore) -> Vec<(String, Vec<u32>)> {
    let data = varmap.data().lock().unwrap();
    let mut out: Vec<_> = data
        .iter()
        .map(|(name, var)| {
            let g = grads.get(var).unwrap_or_else(|| panic!("{name} got no gradient"));
            let g: Vec<f32> = g.flatten_all().unwrap().to_vec1().unwrap();
            assert!(g.iter().any(|&x| x != 0.0), "{name}'s gradient is all zeros");
            (name.clone(), g.into_iter().map(f32::to_bits).collect())
        })
        .collect();
    out.sort();
    out
}

#[test]
fn checkpointed_gradients_equal_plain_candle_and_the_peak_falls() -> Result<()> {
    let device = Device::Cpu;
    let (varmap, graph) = new(&CFG, &device)?;
    let inputs = batch(&CFG, 8, 64, 3, &device)?;
    let (seed, step) = (11, 3);
    let plain = bits(&varmap, &graph.plain_loss(&inputs, seed, step)?.backward()?);

    let measure = |policy: &Policy| -> Result<u64> {
        let exec = Executor::new(&graph, policy, varmap.all_vars(), seed)?;
        exec.step(&inputs, step)?; // the first step allocates per-thread buffers for good
        let before = heap_current();
        reset_heap_peak();
        let out = exec.step(&inputs, step)?;
        let peak = heap_peak() - before;
        assert!(
            bits(&varmap, &out.grads) == plain,
            "{policy}: gradients differ from plain candle's"
        );
        eprintln!(
            "{policy}: {} segments, step peak {:.2} MiB",
            exec.segments().len(),
            remat::memory::mib(peak)
        );
        Ok(peak)
    };
    let off = measure(&Policy::Off)?;
    let mut sqrt = 0;
    for policy in ["sqrt", "every-n=2"] {
        let peak = measure(&policy.parse().unwrap())?;
        assert!(peak < off, "{policy}: step peak {peak} B, not below off's {off} B");
        sqrt = if policy == "sqrt" { peak } else { sqrt };
    }

    // A budget halfway between the least any plan reaches and off's peak, as the planner
    // predicts them from a profile of the model.
    let profile = Profile::measure(&graph, &inputs, &varmap.all_vars(), 8, seed)?;
    let fixed = heap_current();

    // `sqrt`'s segments run backward in the units the planner predicts lowest (on candle as
    // published, a unit of several stages saves the copies its variables make, and holds its
    // gradients longer): no higher than one stage at a time, the gradients the same.
    let request: PolicyRequest = "sqrt+units=auto".parse().unwrap();
    let (policy, _) = remat::plan::resolve(&request, &profile, fixed, Grads::Gathered, None)?;
    let peak = measure(&policy)?;
    eprintln!("{request}: {policy}, measured {peak} B (sqrt {sqrt} B)");
    assert!(peak as f64 <= sqrt as f64 * 1.03, "{policy}: {peak} B, above sqrt's {sqrt} B");

    let least = profile.least_peak(Grads::Gathered).estimate.peak;
    let predicted_off = profile.predict_policy(&Policy::Off, Grads::Gathered)?.peak;
    let budget = fixed + (least + predicted_off) / 2;
    let request: PolicyRequest = format!("budget={budget}").parse().unwrap();
    let (policy, plan) = remat::plan::resolve(&request, &profile, fixed, Grads::Gathered, None)?;
    let predicted = plan.expect("a budget gives a plan").estimate.peak;
    let peak = measure(&policy)?;
    eprintln!("{request}: {policy}, predicted {predicted} B, measured {peak} B");
    assert!(peak < off, "{request}: step peak {peak} B, not below off's {off} B");
    // The planner predicts from the same heap meter: its figure is the measured one to a few %.
    assert!(
        (peak as f64 / predicted as f64 - 1.0).abs() < 0.05,
        "{request}: predicted {predicted} B, measured {peak} B"
    );
    Ok(())
}
