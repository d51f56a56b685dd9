//! Half precision through the fused ops (tests/cases/half.rs), on their CPU kernels.

fn route() {
    layers::fused::set_path(layers::fused::Path::Kernel);
}

#[path = "cases/half.rs"]
mod cases;
