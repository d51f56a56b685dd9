//! The step's parameter gradients: their running sums, over stages and micro-batches (Rule 8),
//! and the reports of those that are complete ([`Reporter`]).

use super::ops::add_into;
use crate::memory::tensor_bytes;
use crate::Result;
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

/// Hands the parameters whose gradients are complete to the caller of
/// [`Executor::accumulate_reporting`](super::Executor::accumulate_reporting), each once.
pub(super) struct Reporter<'f, 's> {
    finished: &'f mut dyn FnMut(&[usize], &mut GradStore) -> candle_core::Result<()>,
    /// For each parameter, the stage after whose backward its gradient is complete (`None`: at
    /// the end of the step).
    complete_after: &'s [Option<usize>],
    reported: Vec<bool>,
}

impl<'f, 's> Reporter<'f, 's> {
    pub(super) fn new(
        finished: &'f mut dyn FnMut(&[usize], &mut GradStore) -> candle_core::Result<()>,
        complete_after: &'s [Option<usize>],
    ) -> Self {
        Reporter { finished, complete_after, reported: vec![false; complete_after.len()] }
    }

    /// After stage `i`'s backward: the gradients no earlier stage adds to.
    pub(super) fn after_stage(&mut self, i: usize, store: &mut GradStore) -> Result<()> {
        let ready: Vec<usize> =
            (0..self.complete_after.len()).filter(|&k| self.complete_after[k] == Some(i)).collect();
        self.report(&ready, store)
    }

    /// Whether parameter `k`'s gradient was reported complete already.
    pub(super) fn reported(&self, k: usize) -> bool {
        self.reported[k]
    }

    /// At the end of the step: every parameter not reported yet.
    pub(super) fn rest(&mut self, store: &mut GradStore) -> Result<()> {
        let rest: Vec<usize> = (0..self.reported.len()).filter(|&k| !self.reported[k]).collect();
        self.report(&rest, store)
    }

    fn report(&mut self, ready: &[usize], store: &mut GradStore) -> Result<()> {
        if !ready.is_empty() {
            (self.finished)(ready, store)?;
            ready.iter().for_each(|&k| self.reported[k] = true);
        }
        Ok(())
    }
}

/// The parameter gradients of a step: the running sum (over stages, and over micro-batches when
/// accumulating) and, while accumulating, this micro-batch's partial sums of the parameters that
/// several stages use. Rule 8.
pub(super) struct ParamGrads<'s> {
    pub(super) sum: GradStore,
    partial: GradStore,
    /// Contributions seen this micro-batch, per parameter.
    seen: Vec<usize>,
    /// Contributions a micro-batch gives each parameter (`None`: the first micro-batch, which
    /// sums straight into `sum`).
    expected: Option<&'s [usize]>,
}

impl<'s> ParamGrads<'s> {
    pub(super) fn new(sum: GradStore, expected: Option<&'s [usize]>, n_params: usize) -> Self {
        ParamGrads { sum, partial: GradStore::default(), seen: vec![0; n_params], expected }
    }

    /// Adds one stage's gradient `g` of parameter `k`.
    pub(super) fn add(&mut self, k: usize, p: &Var, g: Tensor) -> Result<()> {
        self.seen[k] += 1;
        let Some(expected) = self.expected else { return add_into(&mut self.sum, p, g) };
        if expected[k] == 1 {
            return add_into(&mut self.sum, p, g);
        }
        add_into(&mut self.partial, p, g)?;
        if self.seen[k] == expected[k] {
            let complete = self.partial.remove(p.as_tensor()).expect("just added");
            add_into(&mut self.sum, p, complete)?;
        }
        Ok(())
    }

    /// Adds the partial sums still aside (contributions that did not all come) to the sum.
    pub(super) fn flush(&mut self, params: &[Var]) -> Result<()> {
        for p in params {
            if let Some(g) = self.partial.remove(p.as_tensor()) {
                add_into(&mut self.sum, p, g)?;
            }
        }
        Ok(())
    }

    pub(super) fn bytes(&self, params: &[Var]) -> u64 {
        grad_bytes(params, &self.sum) + grad_bytes(params, &self.partial)
    }

    /// The sum, and how many stages gave each parameter a gradient.
    pub(super) fn finish(self) -> (GradStore, Vec<usize>) {
        (self.sum, self.seen)
    }
}

/// Bytes of the gradients of `params` that `store` holds.
pub(super) fn grad_bytes(params: &[Var], store: &GradStore) -> u64 {
    params.iter().filter_map(|p| store.get(p)).map(tensor_bytes).sum()
}
