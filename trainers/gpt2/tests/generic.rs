//! GPT-2 with its fused ops on the device-generic route (`ops::fused::Path::Generic`, forced on
//! the CPU, as a GPU would take it): every policy's gradients equal `off`'s on that route bit for
//! bit, they match the kernels' to rounding, and a step's peaks stay within 10 % of the kernel
//! route's. The only test in its binary: the path and the allocator's counter are process-wide.

use candle_core::Device;
use datasets::tokens::Batcher;
use gpt2::{Config, Gpt2};
use ops::fused::{set_path, Path};
use remat::memory::CountingAlloc;
use remat::Executor;
use std::collections::BTreeMap;
use trainable::Model;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const BATCH: usize = 2;
const SEQ: usize = 64;

/// Step 0's gradient bits and the second step's peaks of `policy` on `path`.
fn step(path: Path, policy: &str) -> (BTreeMap<String, Vec<u32>>, testkit::Peaks) {
    set_path(path);
    let cfg = Config::tiny(8, 64);
    let model = Gpt2::new(cfg.clone(), &Device::Cpu, 3).unwrap();
    let text = datasets::text::synthetic_corpus(1, 100_000);
    let data = Batcher::new(datasets::text::byte_tokens(&text), SEQ, cfg.vocab_size, 1).unwrap();
    let inputs = |step: u64| {
        let (x, y) = data.batch(step, BATCH);
        model.inputs(&x, &y, BATCH, SEQ, &Device::Cpu).unwrap()
    };
    let exec =
        Executor::new(model.graph(), &policy.parse().unwrap(), model.params().vars(), 3).unwrap();
    let grads = model.params().grad_bits(&exec.step(&inputs(0), 0).unwrap().grads).unwrap();
    let peaks = testkit::second_step_peaks(&exec, inputs).unwrap();
    set_path(Path::Kernel);
    (grads, peaks)
}

#[test]
fn the_generic_route_trains_gpt2_bit_exactly_within_a_tenth_of_the_kernels_memory() {
    let (kernel_off, kernel_peaks) = step(Path::Kernel, "off");
    let (generic_off, generic_peaks) = step(Path::Generic, "off");
    // `+keep=`: the generic route's ops replayed from the forward's outputs.
    for policy in ["sqrt", "every-two-blocks", "sqrt+keep=matmul+attention"] {
        let (grads, _) = step(Path::Generic, policy);
        assert!(grads == generic_off, "generic route: {policy}'s gradients differ from off's");
    }
    assert_eq!(generic_off.len(), kernel_off.len());
    for (name, k) in &kernel_off {
        let g = &generic_off[name];
        let scale = k.iter().map(|&b| f32::from_bits(b).abs()).fold(1e-6f32, f32::max);
        let err = k
            .iter()
            .zip(g)
            .map(|(&a, &b)| (f32::from_bits(a) - f32::from_bits(b)).abs())
            .fold(0f32, f32::max)
            / scale;
        assert!(
            err < 1e-3,
            "{name}: the generic route's gradient differs from the kernels' by {err:.2e} of its \
             scale"
        );
        assert!(
            g.iter().any(|&b| f32::from_bits(b) != 0.0),
            "{name}: no gradient on the generic route"
        );
    }
    for (what, k, g) in [
        ("step", kernel_peaks.step, generic_peaks.step),
        ("activation", kernel_peaks.activation, generic_peaks.activation),
    ] {
        let ratio = g as f64 / k as f64;
        eprintln!("off {what} peak: kernels {k} B, generic route {g} B ({ratio:.3}x)");
        assert!(
            (0.9..=1.1).contains(&ratio),
            "off {what} peak: the generic route's {g} B is {ratio:.3}x the kernels' {k} B"
        );
    }
}
