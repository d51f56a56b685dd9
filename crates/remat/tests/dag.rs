//! The executor on a DAG with skip edges and a parameter shared across segments: every policy's
//! gradients equal plain candle's bit for bit, with dropout on; and the check can fail.

use candle_core::{Device, Tensor, Var};
use remat::{Executor, Policy, Stage, StageCtx, StageGraph, StageKind};

mod common;
use common::{bits, Dense, SquaredSum, PRODUCTS};

fn weight(seed: u64, n: usize) -> Var {
    let v = remat::rng::RngKey::named(seed, "w").normal(n * n, 0.0, 0.5);
    Var::from_tensor(&Tensor::from_vec(v, (n, n), &Device::Cpu).unwrap()).unwrap()
}

/// A U-Net-shaped graph: e1 -> e2 -> e3(down) -> d2(e3, skip e2) -> d1(d2, skip e1) -> loss,
/// where d1 reuses e1's weight (a parameter shared across segments).
fn graph(ws: &[Var]) -> StageGraph {
    let dense = |i: usize, kind| Dense { w: ws[i].as_tensor().clone(), kind };
    let mut g = StageGraph::new(1);
    let e1 = g.then(dense(0, StageKind::Block), 0).unwrap();
    let e2 = g.then(dense(1, StageKind::DownsampleBlock), e1).unwrap();
    let e3 = g.then(dense(2, StageKind::DownsampleBlock), e2).unwrap();
    let d2 = g.add(dense(3, StageKind::Block), &[e3, e2], 1).unwrap()[0];
    let d1 = g.add(dense(0, StageKind::Block), &[d2, e1], 1).unwrap()[0];
    let loss = g.then(SquaredSum, d1).unwrap();
    g.set_output(loss);
    g
}

fn input() -> Tensor {
    Tensor::from_vec(
        remat::rng::RngKey::named(9, "x").normal(8 * 16, 0.0, 1.0),
        (8, 16),
        &Device::Cpu,
    )
    .unwrap()
}

fn grads_of(policy: &str, replay_rng: bool) -> Vec<Vec<u32>> {
    let ws: Vec<Var> = (0..4).map(|i| weight(i, 16)).collect();
    let g = graph(&ws);
    let mut exec = Executor::new(&g, &policy.parse::<Policy>().unwrap(), ws.clone(), 5).unwrap();
    if !replay_rng {
        exec = exec.without_rng_replay();
    }
    bits(&exec.step(&[input()], 0).unwrap().grads, &ws)
}

fn grads(policy: &str) -> Vec<Vec<u32>> {
    grads_of(policy, true)
}

/// The same graph written out by hand, stage by stage, with one plain candle `backward()`: no
/// executor and no `StageGraph` code involved.
fn plain_candle_grads() -> Vec<Vec<u32>> {
    let ws: Vec<Var> = (0..4).map(|i| weight(i, 16)).collect();
    let dense = |i: usize, w: usize, inputs: &[Tensor]| {
        let ctx = StageCtx::train(5, 0, i);
        Dense { w: ws[w].as_tensor().clone(), kind: StageKind::Block }
            .forward(inputs, &ctx)
            .unwrap()
            .remove(0)
    };
    let e1 = dense(0, 0, &[input()]);
    let e2 = dense(1, 1, std::slice::from_ref(&e1));
    let e3 = dense(2, 2, std::slice::from_ref(&e2));
    let d2 = dense(3, 3, &[e3, e2]);
    let d1 = dense(4, 0, &[d2, e1]);
    let loss = SquaredSum.forward(&[d1], &StageCtx::eval()).unwrap().remove(0);
    bits(&loss.backward().unwrap(), &ws)
}

#[test]
fn off_and_plain_loss_equal_a_hand_written_candle_backward() {
    let plain = plain_candle_grads();
    assert_eq!(grads("off"), plain, "the executor's off");
    let ws: Vec<Var> = (0..4).map(|i| weight(i, 16)).collect();
    let g = graph(&ws);
    assert_eq!(
        bits(&g.plain_loss(&[input()], 5, 0).unwrap().backward().unwrap(), &ws),
        plain,
        "StageGraph::plain_loss"
    );
}

#[test]
fn without_rng_replay_the_dag_gradients_differ() {
    // Negative control: recomputes that draw fresh dropout masks must break bit-exactness.
    for policy in ["sqrt", "before-downsample"] {
        assert_ne!(grads_of(policy, false), grads("off"), "{policy}: the check cannot fail");
    }
}

/// A chain of five dense stages where the first and the fourth share one weight, cut so that
/// both sit in segments that are recomputed: the shared weight's gradient is accumulated across
/// two recomputed segments, in plain candle's order.
#[test]
fn a_parameter_shared_by_two_recomputed_segments() {
    let ws: Vec<Var> = (0..4).map(|i| weight(10 + i, 16)).collect();
    let uses = [0, 1, 2, 0, 3];
    let mut g = StageGraph::new(1);
    let mut x = 0;
    for &w in &uses {
        x = g.then(Dense { w: ws[w].as_tensor().clone(), kind: StageKind::Block }, x).unwrap();
    }
    let loss = g.then(SquaredSum, x).unwrap();
    g.set_output(loss);
    let plain = bits(&g.plain_loss(&[input()], 3, 0).unwrap().backward().unwrap(), &ws);
    for policy in ["every-n=1", "every-two-blocks", "explicit=1,4"] {
        let exec = Executor::new(&g, &policy.parse::<Policy>().unwrap(), ws.clone(), 3).unwrap();
        let segs = exec.segments();
        let seg_of = |stage: usize| segs.iter().position(|r| r.contains(&stage)).unwrap();
        let last = segs.len() - 1;
        assert!(
            seg_of(0) != seg_of(3) && seg_of(0) < last && seg_of(3) < last,
            "{policy}: {segs:?} must recompute both users"
        );
        assert_eq!(bits(&exec.step(&[input()], 0).unwrap().grads, &ws), plain, "{policy}");
    }
}

#[test]
fn dag_gradients_equal_off_bit_for_bit() {
    let off = grads("off");
    assert!(off.iter().all(|g| g.iter().any(|&b| f32::from_bits(b) != 0.0)));
    for policy in [
        "sqrt",
        "every-n=1",
        "every-two-blocks",
        "before-downsample",
        "explicit=1,3",
        "sqrt+keep=matmul",
        "every-n=1+keep=matmul",
        // Backward units (Rule 11): a unit's stages read one another's outputs without `Var`s,
        // the skips among them.
        "off+units=2",
        "off+units=6",
        "before-downsample+units=2",
        "every-n=1+keep=matmul+units=2",
    ] {
        assert_eq!(grads(policy), off, "{policy}");
    }
}

/// Selective recompute: a recompute under `+keep=matmul` computes no product again (it replays
/// the forward's), where the same cut without it computes one per recomputed stage.
#[test]
fn kept_products_are_replayed_not_computed() {
    let products = |policy: &str| {
        let ws: Vec<Var> = (0..4).map(|i| weight(i, 16)).collect();
        let g = graph(&ws);
        let exec = Executor::new(&g, &policy.parse::<Policy>().unwrap(), ws.clone(), 5).unwrap();
        let last = exec.segments().last().unwrap().start;
        let before = PRODUCTS.with(|n| n.get());
        exec.step(&[input()], 0).unwrap();
        (PRODUCTS.with(|n| n.get()) - before, last)
    };
    let (off, _) = products("off");
    assert_eq!(off, 5, "one product per dense stage");
    for policy in ["every-n=1", "before-downsample"] {
        let (full, recomputed) = products(policy);
        assert_eq!(full, off + recomputed, "{policy}: one product again per recomputed stage");
        assert_eq!(
            products(&format!("{policy}+keep=matmul")).0,
            off,
            "{policy}+keep=matmul computed a kept product again"
        );
    }
}

#[test]
fn skip_values_are_stored_across_segments() {
    let ws: Vec<Var> = (0..4).map(|i| weight(i, 4)).collect();
    let g = graph(&ws);
    let exec = Executor::new(&g, &Policy::BeforeDownsample, ws, 0).unwrap();
    // Segments start at e2 and e3; stored: e1 (input of e2, skip into d1) and e2 (input of e3, skip
    // into d2).
    assert_eq!(exec.segments(), vec![0..1, 1..2, 2..6]);
    assert_eq!(exec.stored_values(), vec![1, 2]);
}
