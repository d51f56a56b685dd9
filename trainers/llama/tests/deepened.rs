//! A profile measured on a shallow model and deepened to the full depth (how the harness projects
//! a model whose weights do not fit in memory: Llama-3.1-8B's are 32 GB in f32) equals the
//! profile measured on the deep model: every stage's wiring and byte figures (those the allocator
//! measures within 1 KiB), every value's bytes, the tied embedding's shared gradient; the
//! planner's predictions from the two are the same. The only test in its binary: the counting
//! allocator is process-wide.

use candle_core::Device;
use llama::{Architecture, Config, Llama};
use remat::plan::Profile;
use trainable::Model;

#[global_allocator]
static ALLOC: remat::memory::CountingAlloc = remat::memory::CountingAlloc;

fn profile(layers: usize) -> Profile {
    let cfg = Config { num_hidden_layers: layers, ..Config::tiny(Architecture::Qwen3) };
    let model = Llama::new(cfg, &Device::Cpu, 1).unwrap();
    let data = datasets::tokens::Batcher::synthetic(32, model.config.vocab_size, 1).unwrap();
    let inputs = |n: usize| {
        let (x, y) = data.batch(0, n);
        model.inputs(&x, &y, n, 32, &Device::Cpu)
    };
    let (graph, params) = model.parts();
    Profile::at_batch(graph, inputs, &params.vars(), 2, 0).unwrap()
}

#[test]
fn a_shallow_profile_deepened_equals_the_deep_one() {
    // Every pool thread's packing buffer made first, as the trainers do: left to chance, the
    // deep model's head met a thread's first product in both of its measurements (CI saw its
    // backward transient 2 MiB, one Xeon L2, above the shallow model's).
    ops::allocate_matmul_workspaces();
    let (deep, shallow) = (profile(6), profile(2));
    // After model.layers.1: four more blocks.
    let deepened = shallow.deepened(2, 4).unwrap();
    // Exact: each stage's wiring and its parameters' gradients. The bytes a stage keeps and its
    // transients are measured by the allocator, apart in the two models: within what the pool
    // threads allocate for themselves (CI saw 24 bytes in the embedding's kept bytes).
    let exact = |p: &Profile| -> Vec<_> {
        let stages = p
            .stages
            .iter()
            .map(|s| ((s.inputs.clone(), s.outputs.clone(), s.kind), s.param_grad_bytes));
        stages.collect()
    };
    assert_eq!(exact(&deepened), exact(&deep));
    const SLACK: u64 = 1 << 10;
    for (a, b) in deepened.stages.iter().zip(&deep.stages) {
        for (what, x, y) in [
            ("graph bytes", a.graph_bytes, b.graph_bytes),
            ("chain bytes", a.chain_bytes, b.chain_bytes),
            ("graph transient", a.graph_transient, b.graph_transient),
            ("chain transient", a.chain_transient, b.chain_transient),
            ("backward transient", a.backward_transient, b.backward_transient),
        ] {
            assert!(x.abs_diff(y) <= SLACK, "{}: {what} {x} B against {y} B", a.name);
        }
    }
    assert_eq!(deepened.values, deep.values);
    assert_eq!(deepened.shared_grads, deep.shared_grads);
    let grads = remat::plan::Grads::Gathered;
    let budget = remat::PolicyRequest::Budget(64 << 20);
    for request in [remat::Policy::Sqrt.into(), remat::Policy::EveryN(2).into(), budget] {
        let predicted = |p: &Profile| {
            let (policy, _) = remat::plan::resolve(&request, p, 0, grads, None).unwrap();
            (policy.to_string(), p.predict_policy(&policy, grads).unwrap().peak)
        };
        let ((policy, peak), (want_policy, want_peak)) = (predicted(&deepened), predicted(&deep));
        assert_eq!(policy, want_policy, "{request}");
        assert!(peak.abs_diff(want_peak) <= SLACK, "{request}: {peak} B against {want_peak} B");
    }
}
