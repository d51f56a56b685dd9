//! The adapter in PEFT's layout (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`)
//! and back, bit for bit, and the merged weights computing what the adapted model does.

#[test]
fn adapters_round_trip_in_peft_layout_and_merge_into_the_base() {
    let base = llama::Config::tiny(llama::Architecture::Qwen3);
    let lora = params::lora::Lora {
        rank: 4,
        alpha: 16.0,
        dropout: 0.0,
        targets: vec!["q_proj".into(), "v_proj".into(), "down_proj".into()],
        init_lora_weights: false,
    };
    let config = llama::Config { lora: Some(lora.clone()), ..base.clone() };
    testkit::assert_lora_files::<llama::Llama>(&config, &base, &lora, 16, 2);
}
