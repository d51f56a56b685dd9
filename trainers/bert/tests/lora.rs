//! `--lora`: the adapters train and nothing else, with gradients equal to plain candle's under
//! every policy, and the base weights' gradients are never held. The only test in its binary:
//! the counting allocator is process-wide.

use remat::memory::CountingAlloc;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn lora_trains_the_adapters_alone_bit_exact_and_without_weight_gradients() {
    let full = bert::Config::tiny(4, 64);
    let lora = params::lora::Lora {
        dropout: 0.1,
        init_lora_weights: false,
        ..params::lora::Lora::new(4, &["query", "key", "value", "dense"])
    };
    let config = bert::Config { lora: Some(lora), ..full.clone() };
    testkit::assert_lora_trains_adapters_only::<bert::Bert>(&config, &full, 8, 1);
}
