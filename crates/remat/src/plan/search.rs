//! The plan search: the segment starts with the least recompute time whose predicted peak fits
//! a budget ([`Profile::plan`]), by dynamic programming over the cut positions, each segment run
//! backward in the units that give it the lowest peak (Rule 11).

use super::walk::Walk;
use super::{Estimate, Grads, Plan, PlanError, Profile};
use crate::keep::OpSet;
use std::ops::Range;

impl Profile {
    /// Stages where a segment may start: blocks and downsampling stages (what the fixed
    /// policies cut at), and stage 0.
    pub(super) fn candidates(&self) -> Vec<usize> {
        self.stages
            .iter()
            .enumerate()
            .filter(|(i, s)| *i == 0 || s.kind.is_block() || s.kind.is_downsample())
            .map(|(i, _)| i)
            .collect()
    }

    /// The plan with the least recompute time whose peak, plus `fixed` (the heap before the step:
    /// parameters, optimizer state, inputs), fits `budget`; equal times go to the lower peak.
    pub fn plan(
        &self,
        budget: u64,
        fixed: u64,
        grads: Grads,
    ) -> std::result::Result<Plan, PlanError> {
        let found = if budget >= fixed { self.search(budget - fixed, grads) } else { None };
        match found {
            Some(plan) => Ok(plan),
            None => {
                let min = self.least_peak(grads);
                let (dominant, dominant_bytes) = min.estimate.at_peak.dominant();
                Err(PlanError::BelowMinimum {
                    budget,
                    fixed,
                    step: min.estimate.peak,
                    plan: min.policy().to_string(),
                    dominant,
                    dominant_bytes,
                })
            }
        }
    }

    /// The plan with the smallest predicted peak (a bisection over budgets of the search
    /// `Profile::plan` makes).
    pub fn least_peak(&self, grads: Grads) -> Plan {
        let all = self
            .stages
            .iter()
            .map(|s| s.graph_bytes + s.chain_bytes + s.graph_transient + s.backward_transient)
            .sum::<u64>()
            + self.values.iter().map(|v| 2 * v.bytes).sum::<u64>()
            + self.param_grad_bytes()
            + grads.held();
        let mut best =
            self.search(all, grads).expect("every plan fits a budget of everything at once");
        let (mut lo, mut hi) = (0u64, best.estimate.peak);
        while lo + 1 < hi {
            let mid = lo + (hi - lo) / 2;
            match self.search(mid, grads) {
                Some(p) => {
                    hi = p.estimate.peak.min(mid);
                    best = p;
                }
                None => lo = mid,
            }
        }
        best
    }

    /// The dynamic programme: for each candidate cut position, the Pareto set of partial plans
    /// by (bytes of stored values all of whose readers lie before the cut, recompute time).
    fn search(&self, step_budget: u64, grads: Grads) -> Option<Plan> {
        let walk = Walk::new(self, OpSet::default(), grads);
        let n = self.stages.len();
        let cuts = self.candidates();
        let mut fronts: Vec<Vec<Partial>> = (0..cuts.len()).map(|_| Vec::new()).collect();
        fronts[0].push(Partial {
            past: 0,
            recompute: 0.0,
            peak: Estimate::default(),
            starts: vec![0],
            units: Vec::new(),
        });
        let mut best: Option<Partial> = None;
        for (ia, &a) in cuts.iter().enumerate() {
            let front = std::mem::take(&mut fronts[ia]);
            for p in &front {
                for (ib, b) in cuts
                    .iter()
                    .copied()
                    .enumerate()
                    .skip(ia + 1)
                    .map(|(i, b)| (Some(i), b))
                    .chain(std::iter::once((None, n)))
                {
                    let last = ib.is_none();
                    let (unit, cost) = walk.best_unit(a..b, last, p.past);
                    if cost.peak > step_budget {
                        continue;
                    }
                    let mut peak = p.peak;
                    peak.merge(&cost);
                    let mut starts = p.starts.clone();
                    let mut units = p.units.clone();
                    units.push(unit);
                    let next = Partial {
                        past: p.past + walk.settled(a, b),
                        recompute: p.recompute + cost.recompute_ms,
                        peak,
                        starts: Vec::new(),
                        units: Vec::new(),
                    };
                    match ib {
                        None => {
                            let better = best.as_ref().is_none_or(|q| {
                                (next.recompute, next.peak.peak) < (q.recompute, q.peak.peak)
                            });
                            if better {
                                best = Some(Partial { starts, units, ..next });
                            }
                        }
                        Some(ib) => {
                            let f = &mut fronts[ib];
                            if !f.iter().any(|q| q.covers(&next)) {
                                f.retain(|q| !next.covers(q));
                                starts.push(b);
                                f.push(Partial { starts, units, ..next });
                            }
                        }
                    }
                }
            }
        }
        let best = best?;
        let segments: Vec<Range<usize>> = best
            .starts
            .iter()
            .zip(best.starts.iter().skip(1).chain(std::iter::once(&n)))
            .map(|(&a, &b)| a..b)
            .collect();
        Some(Plan {
            estimate: self.predict(&segments, &best.units, OpSet::default(), grads),
            starts: best.starts,
            units: best.units,
        })
    }
}

/// A partial plan of the search, up to a cut: the bytes of the stored values settled before it,
/// the recompute time and the peak so far, where its segments start and their backward units.
struct Partial {
    past: u64,
    recompute: f64,
    peak: Estimate,
    starts: Vec<usize>,
    units: Vec<usize>,
}

impl Partial {
    /// Whether it is no worse than `other` by every measure the search keeps (`other` is then
    /// dropped from the Pareto set).
    fn covers(&self, other: &Partial) -> bool {
        self.past <= other.past
            && self.recompute <= other.recompute
            && self.peak.peak <= other.peak.peak
    }
}
