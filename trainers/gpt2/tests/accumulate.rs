//! Gradient accumulation (`Executor::accumulate`) on GPT-2, whose tied embedding gets gradients
//! from two stages: the accumulated gradient is the sum of the micro-batch gradients bit for bit
//! under every policy (dropout on), the mean over micro-batches equals the concatenated batch's
//! gradient within float tolerance (dropout off), and a micro-batch that accumulates peaks no
//! higher above its start than the first one. One test: the counting allocator is process-wide.

use candle_core::backprop::GradStore;
use candle_core::Device;
use datasets::tokens::Batcher;
use gpt2::{Config, Gpt2};
use remat::memory::{CountingAlloc, Meter};
use remat::Executor;
use trainable::Model;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const MICRO: usize = 3;
const BATCH: usize = 2;
const SEQ: usize = 32;

fn data(cfg: &Config) -> Batcher {
    let text = datasets::text::synthetic_corpus(1, 50_000);
    Batcher::new(datasets::text::byte_tokens(&text), SEQ, cfg.vocab_size, 1).unwrap()
}

fn bits(model: &Gpt2, grads: &GradStore) -> std::collections::BTreeMap<String, Vec<u32>> {
    model.params().grad_bits(grads).unwrap()
}

#[test]
fn accumulated_gradients_are_the_sum_of_the_micro_batches() {
    let cfg = Config::tiny(6, 32);
    let model = Gpt2::new(cfg.clone(), &Device::Cpu, 5).unwrap();
    let data = data(&cfg);
    let inputs = |n: u64| {
        let (x, y) = data.batch(n, BATCH);
        model.inputs(&x, &y, BATCH, SEQ, &Device::Cpu).unwrap()
    };
    let vars = model.params().vars();

    // The reference: each micro-batch's gradient on its own, summed in order by candle.
    let plain = Executor::new(model.graph(), &"off".parse().unwrap(), vars.clone(), 0).unwrap();
    let mut sum: Option<GradStore> = None;
    for n in 0..MICRO as u64 {
        let g = plain.step(&inputs(n), n).unwrap().grads;
        sum = Some(match sum {
            None => g,
            Some(mut acc) => {
                for v in &vars {
                    let total = (acc.get(v).unwrap() + g.get(v).unwrap()).unwrap();
                    acc.insert(v.as_tensor(), total);
                }
                acc
            }
        });
    }
    let want = bits(&model, &sum.unwrap());
    assert_eq!(want.len(), vars.len());
    assert!(
        want.values().all(|g| g.iter().any(|&x| f32::from_bits(x) != 0.0)),
        "a parameter got no gradient"
    );

    let mut peaks = Vec::new();
    for policy in ["off", "sqrt", "every-two-blocks"] {
        let exec = Executor::new(model.graph(), &policy.parse().unwrap(), vars.clone(), 0).unwrap();
        let mut grads = GradStore::default();
        for n in 0..MICRO as u64 {
            let inputs = inputs(n);
            let meter = Meter::start(&Device::Cpu);
            grads = exec.accumulate(&inputs, n, grads).unwrap().grads;
            peaks.push((policy, n, meter.finish().heap_peak_delta));
        }
        assert!(
            bits(&model, &grads) == want,
            "{policy}: the accumulated gradient is not the sum of the micro-batch gradients"
        );
    }
    // Micro-batches after the first start with the whole gradient store held (their base): a
    // second store, or a copy of the largest gradient, would show as a higher peak above that
    // base (the slack covers bookkeeping: a few counters per parameter). Under checkpointing the
    // first micro-batch peaks during a recompute with some gradients already made; the later ones
    // add theirs into the existing store, so they peak lower: a store built per micro-batch and
    // added at the end would peak as high as the first.
    const SLACK: u64 = 4096;
    let largest = vars.iter().map(|v| v.elem_count() * 4).max().unwrap() as u64;
    assert!(SLACK < largest / 4);
    for w in peaks.chunks(MICRO) {
        let (policy, _, first) = w[0];
        for &(_, n, peak) in &w[1..] {
            eprintln!(
                "{policy}: micro-batch {n} peaks {peak} B above its start, the first {first} B"
            );
            assert!(
                peak <= first + SLACK,
                "{policy}: micro-batch {n} peaks {peak} B above its start, the first only {first} B"
            );
            assert!(
                policy == "off" || peak < first,
                "{policy}: micro-batch {n} peaks as high as the first ({peak} B)"
            );
        }
    }

    // Dropout off: the mean of the micro-batch gradients is the gradient of the whole batch.
    let cfg = Config { embd_pdrop: 0.0, attn_pdrop: 0.0, resid_pdrop: 0.0, ..cfg };
    let model = Gpt2::new(cfg, &Device::Cpu, 5).unwrap();
    let vars = model.params().vars();
    let exec = Executor::new(model.graph(), &"sqrt".parse().unwrap(), vars.clone(), 0).unwrap();
    let (mut xs, mut ys, mut grads) = (Vec::new(), Vec::new(), GradStore::default());
    for n in 0..MICRO as u64 {
        let (x, y) = data.batch(n, BATCH);
        grads = exec
            .accumulate(&model.inputs(&x, &y, BATCH, SEQ, &Device::Cpu).unwrap(), n, grads)
            .unwrap()
            .grads;
        xs.extend(x);
        ys.extend(y);
    }
    optim::scale_grads(&mut grads, &vars, 1.0 / MICRO as f64).unwrap();
    let whole = exec
        .step(&model.inputs(&xs, &ys, BATCH * MICRO, SEQ, &Device::Cpu).unwrap(), 0)
        .unwrap()
        .grads;
    for (name, v) in model.params().named() {
        let (a, b) = (grads.get(v).unwrap(), whole.get(v).unwrap());
        let scale = b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1e-6);
        let err =
            (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap() / scale;
        assert!(
            err < 1e-5,
            "`{name}`: mean of micro-batches vs whole batch differ by {err:.2e} (relative to its \
             largest element)"
        );
    }
}
