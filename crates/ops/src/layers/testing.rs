//! What the layers' tests share: random operands and the indices of a 5-D grid. Not here: the
//! crate's tests through its public API (`tests/`).

use remat::rng::RngKey;

/// Normal draws, keyed by `name`, for a tensor of `shape`.
pub(crate) fn rand(name: &str, shape: &[usize]) -> Vec<f32> {
    RngKey::named(3, name).normal(shape.iter().product(), 0.0, 1.0)
}

/// Every index (i, j, k, l, m) of an (a, b, c, d, e) grid, in row-major order.
pub(crate) fn grid(
    a: usize,
    b: usize,
    c: usize,
    d: usize,
    e: usize,
) -> impl Iterator<Item = (usize, usize, usize, usize, usize)> {
    (0..a).flat_map(move |i| {
        (0..b).flat_map(move |j| {
            (0..c).flat_map(move |k| (0..d).flat_map(move |l| (0..e).map(move |m| (i, j, k, l, m))))
        })
    })
}
