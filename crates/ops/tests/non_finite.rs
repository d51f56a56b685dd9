//! NaN and infinities through the fused ops (tests/cases/non_finite.rs), on their CPU kernels.

fn route() {
    ops::fused::set_path(ops::fused::Path::Kernel);
}

#[path = "cases/non_finite.rs"]
mod cases;
