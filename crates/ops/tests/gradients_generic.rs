//! Every layer of this crate against central finite differences in f64, and the rules they cannot
//! see (tests/cases/gradients/), with the fused ops on the device-generic route a GPU takes
//! (`Path::Generic`).

fn route() {
    ops::fused::set_path(ops::fused::Path::Generic);
}

#[path = "cases/gradients/mod.rs"]
mod cases;
