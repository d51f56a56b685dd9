//! The planner's dynamic programme against brute force: on small chains and on a U-Net-shaped
//! graph with skip edges, for budgets across the whole range, the plan it picks has the least
//! recompute time (and, among those, the lowest peak) of all boundary subsets that fit, and its
//! least peak is the least of all subsets.

use remat::plan::{Profile, StageCost, ValueCost};
use remat::StageKind;
use std::ops::Range;

/// A deterministic stream of numbers in `0..m`.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, m: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % m
    }
}

fn stage(
    rng: &mut Lcg,
    name: String,
    kind: StageKind,
    inputs: Vec<usize>,
    output: usize,
) -> StageCost {
    let kib = |rng: &mut Lcg, m: u64| (1 + rng.next(m)) << 10;
    StageCost {
        name,
        kind,
        inputs,
        outputs: vec![output],
        graph_bytes: kib(rng, 400),
        chain_bytes: kib(rng, 300),
        graph_transient: kib(rng, 100),
        chain_transient: kib(rng, 100),
        backward_transient: kib(rng, 500),
        backward_retained: 0,
        inputs_retained: Vec::new(),
        param_grad_bytes: kib(rng, 50),
        forward_ms: 1.0 + rng.next(20) as f64,
        backward_ms: 2.0 + rng.next(40) as f64,
        keepable: Vec::new(),
    }
}

/// Values 0 (batch) and 1 (targets) are inputs; stage i writes value 2 + i.
fn values(rng: &mut Lcg, stages: usize) -> Vec<ValueCost> {
    let mut v = vec![ValueCost { bytes: 4096, float: true }, ValueCost { bytes: 64, float: false }];
    v.extend((0..stages).map(|_| ValueCost { bytes: (1 + rng.next(200)) << 10, float: true }));
    v
}

/// stem, `blocks` blocks, loss.
fn chain(seed: u64, blocks: usize) -> Profile {
    let mut rng = Lcg(seed);
    let n = blocks + 2;
    let mut stages = Vec::new();
    for i in 0..n {
        let (kind, inputs) = match i {
            0 => (StageKind::Other, vec![0]),
            i if i == n - 1 => (StageKind::Other, vec![2 + i - 1, 1]),
            i => (StageKind::Block, vec![2 + i - 1]),
        };
        stages.push(stage(&mut rng, format!("s{i}"), kind, inputs, 2 + i));
    }
    Profile { batch: 1, n_inputs: 2, values: values(&mut rng, n), stages, shared_grads: Vec::new() }
}

/// A U-Net: stem, `levels` encoder blocks (each output also a skip), a bottom block, `levels`
/// decoder blocks each reading the previous output and its level's skip, and the loss.
fn unet(seed: u64, levels: usize) -> Profile {
    let mut rng = Lcg(seed);
    let mut stages = vec![stage(&mut rng, "stem".into(), StageKind::Other, vec![0], 2)];
    for l in 0..levels {
        let i = stages.len();
        stages.push(stage(
            &mut rng,
            format!("down{l}"),
            StageKind::DownsampleBlock,
            vec![2 + i - 1],
            2 + i,
        ));
    }
    let i = stages.len();
    stages.push(stage(&mut rng, "bottom".into(), StageKind::Block, vec![2 + i - 1], 2 + i));
    for l in (0..levels).rev() {
        let i = stages.len();
        let skip = 2 + 1 + l; // down{l}'s output
        stages.push(stage(
            &mut rng,
            format!("up{l}"),
            StageKind::Block,
            vec![2 + i - 1, skip],
            2 + i,
        ));
    }
    let i = stages.len();
    stages.push(stage(&mut rng, "loss".into(), StageKind::Other, vec![2 + i - 1, 1], 2 + i));
    let n = stages.len();
    Profile { batch: 1, n_inputs: 2, values: values(&mut rng, n), stages, shared_grads: Vec::new() }
}

fn segments(starts: &[usize], n: usize) -> Vec<Range<usize>> {
    starts
        .iter()
        .zip(starts.iter().skip(1).chain(std::iter::once(&n)))
        .map(|(&a, &b)| a..b)
        .collect()
}

/// Every subset of the stages where a segment may start (blocks, downsampling stages), with
/// its (recompute time, peak).
fn all_plans(p: &Profile) -> Vec<(Vec<usize>, f64, u64)> {
    let cand: Vec<usize> = (1..p.stages.len())
        .filter(|&i| p.stages[i].kind.is_block() || p.stages[i].kind.is_downsample())
        .collect();
    (0..1u64 << cand.len())
        .map(|mask| {
            let starts: Vec<usize> = std::iter::once(0)
                .chain(cand.iter().enumerate().filter(|(k, _)| mask >> k & 1 == 1).map(|(_, &s)| s))
                .collect();
            // Each segment run backward in its best units, as the search runs it (Rule 11).
            let (segments, keep, grads) = (
                segments(&starts, p.stages.len()),
                remat::keep::OpSet::default(),
                remat::plan::Grads::Gathered,
            );
            let e = p.predict(&segments, &p.choose_units(&segments, keep, grads), keep, grads);
            (starts, e.recompute_ms, e.peak)
        })
        .collect()
}

fn agrees_with_brute_force(p: &Profile) {
    let plans = all_plans(p);
    let least = plans.iter().map(|x| x.2).min().unwrap();
    let most = plans.iter().map(|x| x.2).max().unwrap();
    assert_eq!(p.least_peak(remat::plan::Grads::Gathered).estimate.peak, least, "least peak");
    let fixed = 1 << 20;
    for k in 0..=40 {
        let budget = least + (most - least) * k / 40;
        let best = plans
            .iter()
            .filter(|x| x.2 <= budget)
            .map(|x| (x.1, x.2))
            .min_by(|a, b| a.partial_cmp(b).unwrap())
            .unwrap();
        let plan = p.plan(fixed + budget, fixed, remat::plan::Grads::Gathered).unwrap();
        assert_eq!(
            (plan.estimate.recompute_ms, plan.estimate.peak),
            best,
            "budget {budget}: plan {:?}",
            plan.starts
        );
        assert!(plan.estimate.peak <= budget);
    }
    let err =
        p.plan(fixed + least - 1, fixed, remat::plan::Grads::Gathered).unwrap_err().to_string();
    assert!(
        err.contains("below the smallest peak") && err.contains("the state before the step"),
        "{err}"
    );
}

#[test]
fn the_plan_equals_brute_force_on_chains() {
    for seed in 0..6 {
        agrees_with_brute_force(&chain(seed, 9));
    }
}

#[test]
fn the_plan_equals_brute_force_with_skip_edges() {
    for seed in 0..6 {
        agrees_with_brute_force(&unet(100 + seed, 4));
    }
}

/// A skip tensor read in a later segment than its producer's is stored; one read in the same
/// segment is not.
#[test]
fn skips_are_stored_exactly_when_a_cut_separates_them() {
    let p = unet(7, 3);
    // stem 0, down0..2 = 1..3, bottom 4, up2..0 = 5..7, loss 8; down0's output is value 3.
    let n = p.stages.len();
    let off = remat::plan::stored_values(&p, &segments(&[0], n));
    assert!(off.is_empty());
    let cut = remat::plan::stored_values(&p, &segments(&[0, 4], n));
    assert!(cut.contains(&3) && cut.contains(&4) && cut.contains(&5), "{cut:?}");
    let late = remat::plan::stored_values(&p, &segments(&[0, 8], n));
    assert_eq!(late, vec![9], "only up0's output crosses a cut before the loss");
}

/// A chain deepened by repeating a block has the deeper chain's structure (each copy reading the
/// one before, the loss the last copy), the block's costs in every copy, and its shared
/// gradients' stages moved on; a stage of two inputs is refused.
#[test]
fn a_deepened_chain_is_the_deeper_chain() {
    let mut shallow = chain(3, 2);
    shallow.shared_grads = vec![remat::plan::SharedGrad { first: 0, last: 3, bytes: 4096 }];
    let deep = shallow.deepened(2, 3).unwrap();
    let want = chain(3, 5);
    let wiring = |p: &Profile| -> Vec<(Vec<usize>, Vec<usize>)> {
        p.stages.iter().map(|s| (s.inputs.clone(), s.outputs.clone())).collect()
    };
    assert_eq!(wiring(&deep), wiring(&want));
    assert_eq!(deep.values.len(), want.values.len());
    for copy in &deep.stages[3..6] {
        assert_eq!(copy.graph_bytes, shallow.stages[2].graph_bytes);
        assert_eq!(copy.backward_ms, shallow.stages[2].backward_ms);
    }
    assert_eq!(deep.stages[6].name, shallow.stages[3].name, "the loss comes last");
    assert_eq!(deep.values[7].bytes, shallow.values[4].bytes, "the copies' outputs");
    assert_eq!(deep.shared_grads[0].last, 6);
    assert!(shallow.deepened(3, 1).is_err(), "the loss reads two values");
}
