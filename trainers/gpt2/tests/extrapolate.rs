//! The planner's profile extrapolated in the batch (`Profile::extrapolated`, what the full-size
//! projections and the trainers' fit check use) against a profile measured at that batch: the
//! predicted step peaks agree. The only test in its binary: the counting allocator is
//! process-wide.

use candle_core::Device;
use gpt2::{Config, Gpt2};
use remat::memory::CountingAlloc;
use remat::plan::{Grads, Profile};
use trainable::Model;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn a_profile_extrapolated_from_batches_2_and_4_predicts_batch_16() {
    // Every pool thread's packing buffer made first, as the trainers do, so no measurement
    // pays one by chance.
    ops::allocate_matmul_workspaces();
    let model = Gpt2::new(Config::tiny(4, 64), &Device::Cpu, 0).unwrap();
    let batcher = datasets::tokens::Batcher::new(
        datasets::text::byte_tokens(&datasets::text::synthetic_corpus(0, 1 << 16)),
        64,
        256,
        0,
    )
    .unwrap();
    let inputs = |n: usize| -> candle_core::Result<Vec<candle_core::Tensor>> {
        let (x, y) = batcher.batch(0, n);
        model.inputs(&x, &y, n, 64, &Device::Cpu)
    };
    let vars = model.params().vars();
    let extrapolated = Profile::extrapolated(model.graph(), inputs, &vars, (2, 4), 16, 0).unwrap();
    let measured = Profile::at_batch(model.graph(), inputs, &vars, 16, 0).unwrap();
    for policy in ["off", "sqrt", "every-two-blocks"] {
        let policy = policy.parse().unwrap();
        let (e, m) = (
            extrapolated.predict_policy(&policy, Grads::Gathered).unwrap().peak,
            measured.predict_policy(&policy, Grads::Gathered).unwrap().peak,
        );
        let error = e as f64 / m as f64 - 1.0;
        eprintln!("{policy}: extrapolated {e} B, measured {m} B ({:+.1}%)", error * 100.0);
        assert!(
            error.abs() <= 0.05,
            "{policy}: extrapolated {e} B against {m} B measured at batch 16"
        );
    }
}
