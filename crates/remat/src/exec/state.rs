//! State changed in forward: a variable the executor was given that a stage changes while it runs
//! (a candle-nn `BatchNorm` in training mode updates its running statistics with `Var::set`). A
//! recompute would change it a second time, and the state after the step would differ from
//! `off`'s. The first step finds which variables each segment's forward changes, by digests of
//! every variable before the forward and after each segment ([`StateFinder`]); every recompute of
//! such a segment then saves those variables and puts them back after it ([`Saved`]), so the
//! state after a step is `off`'s, bit for bit, however often a stage ran. Variables changed in
//! forward are state, not parameters: no gradient is expected of them.
//!
//! The digest is the recompute check's ([`super::ops::digest`]): up to 1024 elements, evenly
//! spread, so a change confined to elements it does not read (of a variable above 1024
//! elements) goes unseen; a running statistic changes every element.

use super::ops::digest;
use crate::Result;
use candle_core::{Tensor, Var};

/// The first step's search: the digests of every variable after the last segment seen, and what
/// each segment changed.
pub(super) struct StateFinder {
    digests: Vec<Option<u64>>,
    changed_by: Vec<Vec<usize>>,
}

impl StateFinder {
    /// Before the forward: the variables' digests.
    pub(super) fn start(params: &[Var]) -> Result<Self> {
        Ok(StateFinder { digests: digests(params)?, changed_by: Vec::new() })
    }

    /// After the next segment's forward: the variables it changed.
    pub(super) fn after_segment(&mut self, params: &[Var]) -> Result<()> {
        let now = digests(params)?;
        let changed = (0..params.len()).filter(|&k| now[k] != self.digests[k]).collect();
        self.changed_by.push(changed);
        self.digests = now;
        Ok(())
    }

    /// For each segment, the indices of the variables its forward changed.
    pub(super) fn finish(self) -> Vec<Vec<usize>> {
        self.changed_by
    }
}

fn digests(params: &[Var]) -> Result<Vec<Option<u64>>> {
    params.iter().map(|p| digest(p.as_tensor())).collect()
}

/// Variables saved before a recompute, put back after it.
pub(super) struct Saved(Vec<(Var, Tensor)>);

impl Saved {
    /// Copies of `params[k]` for each `k` of `changed`.
    pub(super) fn save(params: &[Var], changed: &[usize]) -> Result<Self> {
        let saved = changed.iter().map(|&k| Ok((params[k].clone(), params[k].as_tensor().copy()?)));
        Ok(Saved(saved.collect::<Result<_>>()?))
    }

    /// Every variable back to its saved value.
    pub(super) fn restore(self) -> Result<()> {
        for (var, value) in self.0 {
            var.set(&value)?;
        }
        Ok(())
    }
}
