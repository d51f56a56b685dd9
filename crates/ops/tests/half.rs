//! Half precision through the fused ops (tests/cases/half.rs), on their CPU kernels.

fn route() {
    ops::fused::set_path(ops::fused::Path::Kernel);
}

#[path = "cases/half.rs"]
mod cases;
