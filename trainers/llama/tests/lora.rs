//! `--lora` over the Llama family: the adapters train and nothing else, with gradients equal to
//! plain candle's under every policy, and the base weights' gradients are never held. The only
//! test in its binary: the counting allocator is process-wide.

use remat::memory::CountingAlloc;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn lora_trains_the_adapters_alone_bit_exact_and_without_weight_gradients() {
    let full = llama::Config::tiny(llama::Architecture::Qwen2);
    let lora = params::lora::Lora {
        rank: 4,
        alpha: 8.0,
        dropout: 0.1,
        targets: llama::LORA_TARGETS.iter().map(|t| t.to_string()).collect(),
        init_lora_weights: false,
    };
    let config = llama::Config { lora: Some(lora), ..full.clone() };
    testkit::assert_lora_trains_adapters_only::<llama::Llama>(&config, &full, 8, 1);
}
