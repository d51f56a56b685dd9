//! `--save-adapter`, `--load-adapter`, `--save-merged`: the adapter in PEFT's layout and back, bit
//! for bit, and the merged weights computing what the adapted model does.

#[test]
fn adapters_round_trip_in_peft_layout_and_merge_into_the_base() {
    let base = bert::Config::tiny(2, 32);
    let lora = params::lora::Lora {
        rank: 4,
        alpha: 16.0,
        dropout: 0.0,
        targets: vec!["query".into(), "value".into(), "output.dense".into()],
        init_lora_weights: false,
    };
    let config = bert::Config { lora: Some(lora.clone()), ..base.clone() };
    testkit::assert_lora_files::<bert::Bert>(&config, &base, &lora, 16, 2);
}
