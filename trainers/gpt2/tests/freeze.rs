//! `--freeze`: the frozen parameters get no gradient, computed or stored, and the others' are
//! those of the model with nothing frozen, bit for bit, under every policy.

#[test]
fn frozen_parameters_get_no_gradient_and_change_no_other() {
    let config = gpt2::Config::tiny(4, 32);
    let frozen = {
        let mut c = config.clone();
        c.freeze = "h.*.attn.*,wte.weight".parse().unwrap();
        c
    };
    testkit::assert_frozen_parameters_get_no_gradient::<gpt2::Gpt2>(&config, &frozen, 32, 2);
}
