//! Checkpointing policies: which stage boundaries are stored.
//!
//! A [`Policy`] names the stages whose inputs start a new segment, so it always cuts a graph.
//! Everything that crosses a segment boundary is stored in forward; everything inside a segment
//! is discarded and recomputed in backward. The last segment is never recomputed: its forward
//! graph is kept for backward.
//!
//! What a user asks for with `--policy` is a [`PolicyRequest`]: a policy, or `budget=SIZE` and
//! `auto`, requests to the planner ([`crate::plan`]) that become a [`Policy::BeforeStages`] plan
//! once the model's stages have been profiled ([`crate::plan::resolve`]).

use crate::graph::{stages_of_kind, StageGraph};
use crate::keep::OpSet;
use crate::stage::StageKind;
use std::fmt;
use std::ops::Range;
use std::str::FromStr;

/// Which stage boundaries a step stores (see the module documentation and `PolicyRequest`).
/// Serialized as a tagged structure (what ranks exchange), written and parsed as its name.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Policy {
    /// Plain candle: one segment, every activation kept.
    Off,
    /// Segments of ceil(sqrt(L)) blocks: about sqrt(L) stored boundaries.
    Sqrt,
    /// A boundary before every K-th block (`every-two-blocks` is K = 2).
    EveryN(usize),
    /// A boundary before every downsampling stage (U-Net: the skip tensors).
    BeforeDownsample,
    /// `explicit=I,J,...`: a boundary before each listed block, counted among the blocks only
    /// (0-based; the stem, pooling and head are not blocks).
    BeforeBlocks(Vec<usize>),
    /// `plan=I,J,...`: a boundary before each listed stage, counted among all stages (what the
    /// planner chooses; any stage may start a segment).
    BeforeStages(Vec<usize>),
    /// `POLICY+keep=OPS`: `POLICY`'s segments, whose recomputes replay the outputs of the ops
    /// named (`matmul`, `conv`, `attention`, joined by `+`) kept from the forward instead of
    /// computing them again (selective recompute, [`crate::keep`]).
    Keep(Box<Policy>, OpSet),
    /// `POLICY+units=K` (or `K1,K2,...`, one per segment): `POLICY`'s segments, each one's graphs
    /// built and run backward K stages at a time (backward units, [`crate::rules`] Rule 11)
    /// instead of one stage at a time. A unit reads the values its own stages produce as they
    /// are, not through variables: on candle as published, where each such variable is a copy,
    /// that saves the copies, and costs holding the unit's activations until its whole backward
    /// has run.
    Units(Box<Policy>, Vec<usize>),
}

/// What `--policy` asks for: a policy, or the planner's choice for a memory budget.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum PolicyRequest {
    /// A policy, as it is.
    Fixed(Policy),
    /// The plan with the least recompute whose predicted peak, model state included, fits this
    /// many bytes.
    Budget(u64),
    /// `budget=` with the memory the device has free, less a margin (CUDA), or the memory cap
    /// the run is given (CPU).
    Auto,
    /// `POLICY+units=auto`: the policy's segments, each one's backward unit chosen by the planner
    /// (the size whose predicted peak is lowest; see [`Policy::Units`]).
    ChooseUnits(Policy),
}

/// Why a policy was refused.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// A name that is no policy.
    #[error("unknown policy `{0}`; valid policies: {VALID}")]
    Unknown(String),
    #[allow(missing_docs)] // its fields are what its message names
    #[error("policy `{policy}`: {why}; valid policies: {VALID}")]
    Invalid { policy: String, why: String },
    #[allow(missing_docs)] // its fields are what its message names
    #[error("policy `{policy}` does not apply to this model: {why}")]
    NotApplicable { policy: String, why: String },
    /// `budget=` or `auto` where a fixed policy is needed.
    #[error(
        "`{0}` is a request to the planner, not a policy: resolve it from the model's profile \
         first (remat::plan::resolve)"
    )]
    NeedsPlan(String),
}

const VALID: &str = "off, sqrt, every-two-blocks, every-n=K (K >= 1), before-downsample, \
    explicit=I,J,... (block indices), plan=I,J,... (stage indices), budget=SIZE (e.g. 2GiB), auto; \
    POLICY+keep=OPS (OPS from matmul, conv, attention, joined by +: selective recompute); \
    and POLICY+units=K, K1,K2,... (one per segment) or auto (stages per backward unit)";

impl FromStr for PolicyRequest {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid =
            |why: &str| PolicyError::Invalid { policy: s.to_string(), why: why.to_string() };
        let list = |v: &str| -> Result<Vec<usize>, PolicyError> {
            v.split(',')
                .map(|i| {
                    i.trim()
                        .parse::<usize>()
                        .map_err(|_| invalid("expected comma-separated block indices"))
                })
                .collect()
        };
        let fixed = |p| Ok(PolicyRequest::Fixed(p));
        if let Some((cut, units)) = s.trim().rsplit_once("+units=") {
            let Some(policy) = cut.parse::<PolicyRequest>()?.fixed().cloned() else {
                return Err(invalid(
                    "units= goes with a policy that cuts; a request to the planner chooses its \
                     units itself",
                ));
            };
            if matches!(policy, Policy::Units(..)) {
                return Err(invalid("units= is given twice"));
            }
            if units.trim() == "auto" {
                return Ok(PolicyRequest::ChooseUnits(policy));
            }
            let sizes = list(units)?;
            if sizes.is_empty() || sizes.contains(&0) {
                return Err(invalid("units= takes stage counts >= 1, or auto"));
            }
            return fixed(Policy::Units(Box::new(policy), sizes));
        }
        if let Some((cut, ops)) = s.trim().split_once("+keep=") {
            let keep: OpSet = ops.parse().map_err(|e: String| invalid(&e))?;
            return match cut.parse::<PolicyRequest>()? {
                PolicyRequest::Fixed(Policy::Off) => {
                    Err(invalid("`off` recomputes nothing, so it has nothing to keep"))
                }
                PolicyRequest::Fixed(p) => fixed(Policy::Keep(Box::new(p), keep)),
                _ => Err(invalid(
                    "keep= goes with a policy that cuts, not with a request to the planner",
                )),
            };
        }
        match s.trim() {
            "off" => fixed(Policy::Off),
            "sqrt" => fixed(Policy::Sqrt),
            "every-two-blocks" => fixed(Policy::EveryN(2)),
            "before-downsample" => fixed(Policy::BeforeDownsample),
            "auto" => Ok(PolicyRequest::Auto),
            t => match t.split_once('=') {
                Some(("every-n", k)) => match k.trim().parse::<usize>() {
                    Ok(k) if k >= 1 => fixed(Policy::EveryN(k)),
                    _ => Err(invalid("K must be an integer >= 1")),
                },
                Some(("explicit", v)) => fixed(Policy::BeforeBlocks(list(v)?)),
                // An empty plan is one segment (what a budget that fits `off` gives).
                Some(("plan", v)) => fixed(Policy::BeforeStages(if v.trim().is_empty() {
                    Vec::new()
                } else {
                    list(v)?
                })),
                Some(("budget", v)) => Ok(PolicyRequest::Budget(
                    crate::memory::parse_size(v).map_err(|e| invalid(&e))?,
                )),
                _ => Err(PolicyError::Unknown(s.to_string())),
            },
        }
    }
}

/// A policy by name; `budget=` and `auto` are refused ([`PolicyError::NeedsPlan`]).
impl FromStr for Policy {
    type Err = PolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.parse::<PolicyRequest>()? {
            PolicyRequest::Fixed(p) => Ok(p),
            _ => Err(PolicyError::NeedsPlan(s.trim().to_string())),
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::Off => write!(f, "off"),
            Policy::Sqrt => write!(f, "sqrt"),
            Policy::EveryN(2) => write!(f, "every-two-blocks"),
            Policy::EveryN(k) => write!(f, "every-n={k}"),
            Policy::BeforeDownsample => write!(f, "before-downsample"),
            Policy::BeforeBlocks(v) => write!(f, "explicit={}", joined(v)),
            Policy::BeforeStages(v) => write!(f, "plan={}", joined(v)),
            Policy::Keep(cut, keep) => write!(f, "{cut}+keep={keep}"),
            Policy::Units(cut, sizes) => write!(f, "{cut}+units={}", joined(sizes)),
        }
    }
}

impl fmt::Display for PolicyRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicyRequest::Fixed(p) => p.fmt(f),
            PolicyRequest::Budget(bytes) => {
                write!(f, "budget={}", crate::memory::format_size(*bytes))
            }
            PolicyRequest::Auto => write!(f, "auto"),
            PolicyRequest::ChooseUnits(p) => write!(f, "{p}+units=auto"),
        }
    }
}

impl From<Policy> for PolicyRequest {
    fn from(p: Policy) -> Self {
        PolicyRequest::Fixed(p)
    }
}

impl PolicyRequest {
    /// The policy asked for, where it is one (not `budget=` or `auto`).
    pub fn fixed(&self) -> Option<&Policy> {
        match self {
            PolicyRequest::Fixed(p) => Some(p),
            _ => None,
        }
    }
}

fn joined(v: &[usize]) -> String {
    v.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

impl Policy {
    /// The ops whose outputs the recomputes replay (empty but for `+keep=`).
    pub fn keeps(&self) -> OpSet {
        match self {
            Policy::Keep(_, keep) => *keep,
            Policy::Units(cut, _) => cut.keeps(),
            _ => OpSet::default(),
        }
    }

    /// How many stages each of `segments` segments runs backward at a time (1 but for
    /// `+units=`; Rule 11).
    pub fn units(&self, segments: usize) -> Result<Vec<usize>, PolicyError> {
        match self {
            Policy::Units(_, sizes) if sizes.len() == 1 => Ok(vec![sizes[0]; segments]),
            Policy::Units(_, sizes) if sizes.len() == segments => Ok(sizes.clone()),
            Policy::Units(_, sizes) => Err(PolicyError::NotApplicable {
                policy: self.to_string(),
                why: format!(
                    "units= gives one size for every segment or one per segment: {} given, the \
                     policy cuts {segments} segments",
                    sizes.len()
                ),
            }),
            _ => Ok(vec![1; segments]),
        }
    }

    /// The policy with `units` stages per backward unit in its segments, in order (`+units=`;
    /// none where every unit is one stage).
    pub fn with_units(&self, units: &[usize]) -> Policy {
        let cut = match self {
            Policy::Units(cut, _) => cut.as_ref().clone(),
            p => p.clone(),
        };
        if units.iter().all(|&k| k == 1) {
            cut
        } else {
            Policy::Units(Box::new(cut), units.to_vec())
        }
    }

    /// Cuts the graph's stages into contiguous segments.
    pub fn segments(&self, graph: &StageGraph) -> Result<Vec<Range<usize>>, PolicyError> {
        self.segments_of(&graph.kinds())
    }

    /// Cuts stages of these kinds, in order, into contiguous segments.
    pub fn segments_of(&self, kinds: &[StageKind]) -> Result<Vec<Range<usize>>, PolicyError> {
        let not_applicable =
            |why: String| PolicyError::NotApplicable { policy: self.to_string(), why };
        let of_kind = |keep| stages_of_kind(kinds, keep);
        let blocks = of_kind(StageKind::is_block);
        let n = kinds.len();
        let starts: Vec<usize> = match self {
            Policy::Off => vec![],
            Policy::Sqrt => every(&blocks, (blocks.len() as f64).sqrt().ceil().max(1.0) as usize),
            Policy::EveryN(k) => every(&blocks, *k),
            Policy::BeforeDownsample => {
                let down = of_kind(StageKind::is_downsample);
                if down.is_empty() {
                    return Err(not_applicable("the model has no downsampling stage".into()));
                }
                down
            }
            Policy::BeforeBlocks(idx) => idx
                .iter()
                .map(|&i| {
                    blocks.get(i).copied().ok_or_else(|| {
                        not_applicable(format!(
                            "block {i} does not exist (the model has {} blocks)",
                            blocks.len()
                        ))
                    })
                })
                .collect::<Result<_, _>>()?,
            Policy::BeforeStages(starts) => match starts.iter().find(|&&s| s >= n) {
                Some(s) => {
                    return Err(not_applicable(format!(
                        "stage {s} does not exist (the model has {n} stages)"
                    )))
                }
                None => starts.clone(),
            },
            Policy::Keep(cut, _) | Policy::Units(cut, _) => return cut.segments_of(kinds),
        };
        let mut cuts: Vec<usize> =
            std::iter::once(0).chain(starts).chain(std::iter::once(n)).collect();
        cuts.sort_unstable();
        cuts.dedup();
        Ok(cuts.windows(2).map(|w| w[0]..w[1]).collect())
    }
}

/// Boundaries before blocks K, 2K, 3K, ... (block 0's input is the segment start anyway).
fn every(blocks: &[usize], k: usize) -> Vec<usize> {
    blocks
        .iter()
        .copied()
        .enumerate()
        .filter(|(i, _)| i % k == 0 && *i > 0)
        .map(|(_, s)| s)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stage::{Stage, StageCtx, StageKind};
    use candle_core::Tensor;

    struct Dummy(StageKind);
    impl Stage for Dummy {
        fn name(&self) -> String {
            "dummy".into()
        }
        fn kind(&self) -> StageKind {
            self.0
        }
        fn forward(&self, inputs: &[Tensor], _: &StageCtx) -> candle_core::Result<Vec<Tensor>> {
            Ok(inputs.to_vec())
        }
    }

    /// stem, pool, 9 blocks (3 and 6 downsample), head: 12 stages.
    fn graph() -> StageGraph {
        let mut g = StageGraph::new(1);
        let mut x = g.then(Dummy(StageKind::Other), 0).unwrap();
        x = g.then(Dummy(StageKind::Downsample), x).unwrap();
        for i in 0..9 {
            let kind = if i == 3 || i == 6 { StageKind::DownsampleBlock } else { StageKind::Block };
            x = g.then(Dummy(kind), x).unwrap();
        }
        g.then(Dummy(StageKind::Other), x).unwrap();
        g
    }

    #[test]
    fn parse_and_display_round_trip() {
        for s in [
            "off",
            "sqrt",
            "every-two-blocks",
            "every-n=3",
            "before-downsample",
            "explicit=1,4",
            "plan=0,3,7",
            "plan=",
            "budget=2GiB",
            "budget=300MiB",
            "auto",
            "sqrt+keep=matmul+attention",
            "plan=2+keep=conv",
            "sqrt+units=2",
            "plan=2,5+units=1,3,2",
            "sqrt+keep=matmul+units=4",
            "off+units=auto",
        ] {
            assert_eq!(s.parse::<PolicyRequest>().unwrap().to_string(), s);
        }
        assert_eq!(
            "budget=1.5GiB".parse::<PolicyRequest>().unwrap(),
            PolicyRequest::Budget(1536 << 20)
        );
        assert_eq!("every-n=2".parse::<Policy>().unwrap(), Policy::EveryN(2));
        assert!(matches!("auto".parse::<Policy>(), Err(PolicyError::NeedsPlan(_))));
    }

    #[test]
    fn bad_names_list_the_valid_ones() {
        for bad in [
            "sqrtt",
            "every-n=0",
            "every-n=x",
            "explicit=a",
            "",
            "budget=lots",
            "budget=-1GiB",
            // Beyond u64: was clamped to u64::MAX, silently.
            "budget=18446744073709551616",
            "budget=0.5",
            "sqrt+keep=gemm",
            "off+keep=matmul",
            "auto+keep=conv",
            "sqrt+units=0",
            "sqrt+units=",
            "budget=1GiB+units=2",
            "sqrt+units=2+units=3",
        ] {
            let e = bad.parse::<PolicyRequest>().unwrap_err().to_string();
            assert!(e.contains("every-two-blocks") && e.contains("before-downsample"), "{e}");
        }
    }

    #[test]
    fn segments_cover_the_stages() {
        let g = graph();
        let seg = |p: &str| p.parse::<Policy>().unwrap().segments(&g).unwrap();
        assert_eq!(seg("off"), vec![0..12]);
        // ceil(sqrt(9)) = 3 blocks per segment; blocks are stages 2..=10 (the pool is no block).
        assert_eq!(seg("sqrt"), vec![0..5, 5..8, 8..12]);
        assert_eq!(seg("every-two-blocks"), vec![0..4, 4..6, 6..8, 8..10, 10..12]);
        assert_eq!(seg("before-downsample"), vec![0..1, 1..5, 5..8, 8..12]);
        assert_eq!(seg("explicit=0,5"), vec![0..2, 2..7, 7..12]);
        assert_eq!(seg("plan=1,6"), vec![0..1, 1..6, 6..12]);
        assert_eq!(seg("sqrt+keep=matmul"), seg("sqrt"), "keep= leaves the cuts as they are");
        assert_eq!(seg("sqrt+units=2"), seg("sqrt"), "units= leaves the cuts as they are");
        let units = |p: &str| p.parse::<Policy>().unwrap().units(3);
        assert_eq!(units("sqrt").unwrap(), [1, 1, 1]);
        assert_eq!(units("sqrt+units=2").unwrap(), [2, 2, 2]);
        assert_eq!(units("sqrt+units=1,3,2").unwrap(), [1, 3, 2]);
        assert!(units("sqrt+units=1,3").unwrap_err().to_string().contains("3 segments"));
        assert!(seg_err(&g, "plan=12").contains("stage 12 does not exist"));
        assert!(seg_err(&g, "explicit=9").contains("block 9 does not exist"));
    }

    fn seg_err(g: &StageGraph, p: &str) -> String {
        p.parse::<Policy>().unwrap().segments(g).unwrap_err().to_string()
    }

    #[test]
    fn before_downsample_needs_a_downsampling_stage() {
        let mut g = StageGraph::new(1);
        g.then(Dummy(StageKind::Block), 0).unwrap();
        assert!(seg_err(&g, "before-downsample").contains("no downsampling stage"));
    }
}
