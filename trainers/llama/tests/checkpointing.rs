//! Checkpointing must not change training: for each architecture (Llama, Qwen2 with its q/k/v
//! bias, Qwen3 with its q/k norms), gradients and losses under every policy equal `off` bit for
//! bit with dropout on (attention dropout, and LoRA's), every parameter gets a gradient, and the
//! negative control (no RNG replay) breaks it.

use candle_core::Device;
use datasets::tokens::{Batcher, Padded};
use llama::{Architecture, Config, Llama};
use params::lora::Lora;
use testkit::checkpointing::{Control, Training};
use trainable::Precision;

const ARCHITECTURES: [Architecture; 3] =
    [Architecture::Llama, Architecture::Qwen2, Architecture::Qwen3];

/// A tiny model of 6 layers with attention dropout 0.1, trained with AdamW on batches of 2 x 32
/// windows of a text.
fn check(cfg: Config, run: impl FnOnce(&Training<Llama>)) {
    let text = datasets::text::synthetic_corpus(1, 100_000);
    let data = Batcher::new(datasets::text::byte_tokens(&text), 32, cfg.vocab_size, 1).unwrap();
    check_on(cfg, &|step| data.batch(step, 2), run)
}

/// [`check`] on the batches `batch(step)` gives, 2 x 32 each.
fn check_on(
    cfg: Config,
    batch: &dyn Fn(u64) -> (Vec<u32>, Vec<u32>),
    run: impl FnOnce(&Training<Llama>),
) {
    let cfg = Config { num_hidden_layers: 6, ..cfg };
    let build = || Llama::new(cfg.clone(), &Device::Cpu, 42).unwrap();
    let inputs = |model: &Llama, step: u64| {
        let (x, y) = batch(step);
        model.inputs(&x, &y, 2, 32, &Device::Cpu).unwrap()
    };
    let optimizer = trainable::OptimizerKind::Adamw;
    run(&Training { build: &build, inputs: &inputs, optimizer, lr: 1e-3, seed: 7 })
}

/// Adapters of rank 4 on every projection, with LoRA dropout 0.1, over a frozen base.
fn lora() -> Lora {
    Lora {
        rank: 4,
        alpha: 8.0,
        dropout: 0.1,
        targets: llama::LORA_TARGETS.iter().map(|t| t.to_string()).collect(),
        init_lora_weights: false,
    }
}

#[test]
fn gradients_equal_off_bit_for_bit() {
    let policies =
        ["sqrt", "every-two-blocks", "every-n=1", "explicit=3", "sqrt+keep=matmul+attention"];
    for architecture in ARCHITECTURES {
        let what = format!("{architecture:?}");
        check(Config::tiny(architecture), |t| {
            t.assert_policies_equal_off(&policies, &what);
            t.assert_every_parameter_learns(&["off", "sqrt"], &what);
        });
    }
}

/// LoRA over a bf16 base (`bf16-weights`: no f32 copy of a frozen weight), and full fine-tuning
/// in bf16: every policy equals `off` bit for bit and every trained parameter learns.
#[test]
fn lora_and_bf16_equal_off_bit_for_bit() {
    for architecture in ARCHITECTURES {
        let lora = Config {
            dtype: Precision::Bf16Weights,
            lora: Some(lora()),
            tie_word_embeddings: true,
            ..Config::tiny(architecture)
        };
        let bf16 = Config { dtype: Precision::Bf16, ..Config::tiny(architecture) };
        for (cfg, what) in [(lora, "LoRA over bf16 weights"), (bf16, "bf16")] {
            let what = format!("{architecture:?}, {what}");
            check(cfg, |t| {
                t.assert_policies_equal_off(&["sqrt", "every-two-blocks", "every-n=1"], &what);
                t.assert_every_parameter_learns(&["off"], &what);
            });
        }
    }
}

/// Examples of different lengths, right-padded, their padding skipped by the loss (`--packing
/// lines`): every policy equals `off` bit for bit.
#[test]
fn padded_examples_equal_off_bit_for_bit() {
    // Documents of 5 to 44 tokens: most shorter than a sequence, some cut into two pieces.
    let tokens = datasets::text::byte_tokens(&datasets::text::synthetic_corpus(2, 20_000));
    let lengths = (0..).map(|i| 5 + (i * 7) % 40);
    let mut at = 0;
    let lines: Vec<Vec<u32>> = lengths
        .map_while(|n| {
            let doc = tokens.get(at..at + n)?.to_vec();
            at += n;
            Some(doc)
        })
        .collect();
    let cfg = Config::tiny(Architecture::Qwen3);
    let data = Padded::new(lines, 32, cfg.vocab_size, ops::fused::IGNORE, 1).unwrap();
    let (_, targets) = data.batch(0, 2);
    assert!(targets.contains(&ops::fused::IGNORE), "the batches must hold padding");
    check_on(cfg, &|step| data.batch(step, 2), |t| {
        t.assert_policies_equal_off(&["sqrt", "every-n=1"], "padded examples");
    });
}

/// Step 0's forward is identical; the recompute draws new dropout masks, so gradients differ.
#[test]
fn without_rng_replay_the_gradients_differ() {
    check(Config::tiny(Architecture::Llama), |t| {
        t.assert_control_breaks("sqrt", Control::NoRngReplay)
    });
}

/// The state the harness counts by arithmetic for a model too big to build (its projections):
/// the parameter and adapter shapes derived from a configuration are the model's.
#[test]
fn parameter_and_adapter_shapes_from_the_configuration_match_the_model() {
    for architecture in [Architecture::Llama, Architecture::Qwen2, Architecture::Qwen3] {
        let full = Config { num_hidden_layers: 2, ..Config::tiny(architecture) };
        let untied = Config { tie_word_embeddings: !full.tie_word_embeddings, ..full.clone() };
        let lora = |targets: &[&str]| Config { lora: Some(Lora::new(4, targets)), ..full.clone() };
        for config in
            [full.clone(), untied, lora(&llama::LORA_TARGETS), lora(&["q_proj", "down_proj"])]
        {
            testkit::checkpointing::assert_parameter_shapes_match_the_model::<Llama>(&config);
        }
    }
}
