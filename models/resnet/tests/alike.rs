//! The planner measures one of each kind of alike stage and reuses its figures for the others
//! (ResNet-50's layout at width 16: each layer's first block projects its input (and the last three downsample), the other twelve reuse the layer's second): its predictions equal those of a profile that measures every stage. The only test in
//! its binary: the counting allocator is process-wide.

use remat::memory::CountingAlloc;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn alike_stages_measured_once_predict_what_measuring_each_does() {
    testkit::assert_alike_stages_predict_as_measured::<resnet::ResNet>(
        &resnet::Config { classes: 10, width: 16, ..resnet::Preset::Resnet50.config() },
        32,
        2,
        12,
    );
}
