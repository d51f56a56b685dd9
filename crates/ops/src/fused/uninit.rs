//! Buffers whose elements are not set, for a kernel that writes every element before anything
//! reads it: zero-filling would be one more pass over memory (and for a fresh allocation, the
//! pass that faults its pages in). Not here: what writes them (each kernel says why it writes
//! them whole at its `unsafe` block).

use super::elem::Elem;

/// A vector of `len` elements whose values are not set: for a buffer that a kernel writes in full
/// before anything reads it, where zero-filling would be one more pass over memory (and for a
/// fresh allocation, the pass that faults its pages in).
///
/// # Safety
/// Every element must be written before it is read.
#[allow(clippy::uninit_vec)]
pub(crate) unsafe fn uninit<T: Elem>(len: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(len);
    // SAFETY: the capacity is `len`; `T` is f32 or f64, which have no invalid bit patterns, and
    // the caller writes every element before reading it.
    unsafe { v.set_len(len) };
    v
}

/// `len` sums over `terms` terms whose first term writes them whole (so they need no zeros
/// first: see [`uninit`]); zeros where there is no term (an empty batch).
///
/// # Safety
/// With terms, the first must write every element before anything reads it.
pub(crate) unsafe fn sums<T: Elem>(len: usize, terms: usize) -> Vec<T> {
    match terms {
        0 => vec![T::zero(); len],
        // SAFETY: the caller's first term writes every element.
        _ => unsafe { uninit(len) },
    }
}
