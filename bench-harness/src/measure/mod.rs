//! What is measured, in this process: one configuration ([`one`]: warm-up, timed steps, the
//! bit-for-bit gradient check, the planner's prediction), one model projected at its full size
//! ([`projection`]), and the device's self-test ([`selftest`]). The `run` module starts each in a
//! fresh process; the `report` module holds what they return.

pub mod kernels;
pub mod one;
pub mod projection;
pub mod selftest;

pub use one::{run_one, One};
