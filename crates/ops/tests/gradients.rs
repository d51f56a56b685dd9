//! Every layer of this crate against central finite differences in f64, and the rules they cannot
//! see (tests/cases/gradients.rs), with the fused ops on their CPU kernels.

fn route() {
    ops::fused::set_path(ops::fused::Path::Kernel);
}

#[path = "cases/gradients.rs"]
mod cases;
