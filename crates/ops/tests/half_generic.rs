//! Half precision through the fused ops (tests/cases/half.rs), on the device-generic route a GPU
//! takes (`Path::Generic`).

fn route() {
    ops::fused::set_path(ops::fused::Path::Generic);
}

#[path = "cases/half.rs"]
mod cases;
