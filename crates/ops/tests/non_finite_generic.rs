//! NaN and infinities through the fused ops (tests/cases/non_finite.rs), on the device-generic
//! route a GPU takes (`Path::Generic`).

fn route() {
    ops::fused::set_path(ops::fused::Path::Generic);
}

#[path = "cases/non_finite.rs"]
mod cases;
