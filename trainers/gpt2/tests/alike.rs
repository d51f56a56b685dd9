//! The planner measures one of each kind of alike stage and reuses its figures for the others
//! (eight blocks of one width: seven reuse the first): its predictions equal those of a profile
//! that measures every stage. The only test in its binary:
//! the counting allocator is process-wide.

use remat::memory::CountingAlloc;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn alike_stages_measured_once_predict_what_measuring_each_does() {
    testkit::assert_alike_stages_predict_as_measured::<gpt2::Gpt2>(
        &gpt2::Config::tiny(8, 64),
        64,
        4,
        7,
    );
}
