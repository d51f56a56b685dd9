//! `--freeze`: the frozen parameters get no gradient, computed or stored, and the others' are
//! those of the model with nothing frozen, bit for bit, under every policy.

#[test]
fn frozen_parameters_get_no_gradient_and_change_no_other() {
    let config = resnet::Config { classes: 10, ..resnet::Preset::Tiny.config() };
    let frozen = {
        let mut c = config.clone();
        c.freeze = "conv1.*,bn1.*,layer1.*".parse().unwrap();
        c
    };
    testkit::assert_frozen_parameters_get_no_gradient::<resnet::ResNet>(&config, &frozen, 32, 2);
}
