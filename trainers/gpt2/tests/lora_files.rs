//! `--save-adapter`, `--load-adapter`, `--save-merged`: the adapter in PEFT's layout and back, bit
//! for bit, and the merged weights computing what the adapted model does.

#[test]
fn adapters_round_trip_in_peft_layout_and_merge_into_the_base() {
    let base = gpt2::Config::tiny(2, 32);
    let lora = params::lora::Lora {
        rank: 4,
        alpha: 16.0,
        dropout: 0.0,
        targets: vec!["c_attn".into(), "mlp.c_proj".into()],
        init_lora_weights: false,
    };
    let config = gpt2::Config { lora: Some(lora.clone()), ..base.clone() };
    testkit::assert_lora_files::<gpt2::Gpt2>(&config, &base, &lora, 16, 2);
}
