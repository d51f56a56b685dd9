//! NaN and infinities through the fused ops (tests/cases/non_finite.rs), on their CPU kernels.

fn route() {
    layers::fused::set_path(layers::fused::Path::Kernel);
}

#[path = "cases/non_finite.rs"]
mod cases;
