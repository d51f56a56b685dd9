//! `--optimizer-in-backward`: weights equal the ordinary step's bit for bit for every optimizer
//! (BatchNorm statistics updated once per step as ever), and the step never holds every gradient
//! at once. The only test in its binary: the counting allocator is process-wide.

use remat::memory::CountingAlloc;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn the_optimizer_inside_backward_updates_bit_exactly_and_frees_the_gradients() {
    let config = resnet::Config { classes: 10, ..resnet::Preset::Tiny.config() };
    testkit::assert_optimizer_in_backward::<resnet::ResNet>(&config, 32, 2);
}
