//! The planner measures one of each kind of alike stage and reuses its figures for the others:
//! ResNet-50's layout at width 32 and 64x64 (where the blocks' activations, not the stem, set
//! most policies' peaks), where each layer's first block projects its input (the last three also
//! downsample) and the blocks after each layer's second reuse that block's figures, eight in all.
//! Its predictions equal those of a profile that measures every stage. The only test in its
//! binary: the counting allocator is process-wide.

use remat::memory::CountingAlloc;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn alike_stages_measured_once_predict_what_measuring_each_does() {
    testkit::assert_alike_stages_predict_as_measured::<resnet::ResNet>(
        &resnet::Config { classes: 10, width: 32, ..resnet::Preset::Resnet50.config() },
        64,
        2,
        8,
    );
}
