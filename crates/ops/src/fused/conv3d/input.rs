//! A convolution's input: one tensor's elements, or two tensors' whose channels side by side are
//! the input ([`Input`]), read channel by channel where each is; joined into one only where the
//! kernel reads the input in place. Not here: the operand matrix built from it
//! (`operand_matrix`).

use super::layout::Layout;
use super::shape::Conv3dShape;
use crate::fused::elem::Elem;

/// A convolution's input (N, C, D, H, W): one tensor's elements, or two tensors' whose channels
/// side by side are the input (`first` holds channels `..split`).
#[derive(Clone, Copy)]
pub(super) struct Input<'a, T> {
    pub(super) first: &'a [T],
    pub(super) second: &'a [T],
    pub(super) split: usize,
}

impl<'a, T: Elem> Input<'a, T> {
    pub(super) fn whole(x: &'a [T], c: usize) -> Self {
        Input { first: x, second: &[], split: c }
    }

    /// Channel `ch` of sample `n`, `volume` elements.
    pub(super) fn channel(&self, n: usize, ch: usize, c: usize, volume: usize) -> &'a [T] {
        match ch.checked_sub(self.split) {
            None => &self.first[(n * self.split + ch) * volume..][..volume],
            Some(ch) => &self.second[(n * (c - self.split) + ch) * volume..][..volume],
        }
    }
}

impl Conv3dShape {
    /// The concatenation of a two-tensor input x where this convolution reads x's elements in
    /// place (the column matrix, the pointwise product); `None` where x serves as it is (one
    /// tensor, or the patch matrix, which reads each channel where it is: the decoders' case).
    pub(super) fn joined<T: Elem>(&self, x: Input<T>) -> Option<Vec<T>> {
        let in_place = self.pointwise() || self.layout() == Layout::Columns;
        (in_place && !x.second.is_empty()).then(|| {
            (0..self.n)
                .flat_map(|n| {
                    (0..self.c)
                        .flat_map(move |ch| x.channel(n, ch, self.c, self.volume()).iter().copied())
                })
                .collect()
        })
    }
}
