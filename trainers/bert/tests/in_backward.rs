//! `--optimizer-in-backward`: weights equal the ordinary step's bit for bit for every optimizer,
//! and the step never holds every gradient at once. The only test in its binary: the counting
//! allocator is process-wide.

use remat::memory::CountingAlloc;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn the_optimizer_inside_backward_updates_bit_exactly_and_frees_the_gradients() {
    testkit::assert_optimizer_in_backward::<bert::Bert>(&bert::Config::tiny(4, 32), 16, 2);
}
