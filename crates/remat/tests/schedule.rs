//! The planner's replay of a step ([`Profile::timeline`]) against the executor's timeline, on a
//! U-Net-shaped graph with skip edges and a weight shared by its first and last block, under every
//! kind of policy. Both follow the bookkeeping rules of `remat::rules`; a rule changed on one
//! side only fails here. Compared:
//! - the stored values (Rule 1) and the events, phase and stage in order (Rule 3): equal;
//! - the parameter gradients held at every event (Rule 8), alone, accumulating on an earlier
//!   micro-batch's (the shared weight's partial sum) and freed as each is complete (the optimizer
//!   inside backward): equal, but for the record of each tensor, which the planner counts and the
//!   event's figure leaves out;
//! - the bytes held at every event (Rules 2, 4 to 7): equal within [`NOISE`];
//! - the step's peak: within the bench harness's tolerance for its predictions (3 %,
//!   `bench-harness/tests/planner.rs`).
//!
//! The only test in its binary: the counting allocator is process-wide, and tests of one binary
//! run concurrently.

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use remat::keep::OpSet;
use remat::memory::{heap_current, tensor_overhead, CountingAlloc, Event};
use remat::plan::{Grads, Point, Profile};
use remat::{Executor, Policy, StageGraph, StageKind};

mod common;
use common::{Dense, SquaredSum};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const WIDTH: usize = 64;
const BATCH: usize = 128;
const SEED: u64 = 5;
/// Bytes of every value (32 KiB) and of every parameter gradient (16 KiB).
const VALUE_BYTES: u64 = (BATCH * WIDTH * 4) as u64;
const GRAD_BYTES: u64 = (WIDTH * WIDTH * 4) as u64;

/// How far the heap an event records may be from the planner's figure: the records of the
/// tensors held (a few hundred bytes each, which a value's bytes leave out), the executor's maps
/// and its growing timeline. At most 4.5 KiB on this graph; a rule applied on one side only moves
/// a whole value or parameter gradient.
const NOISE: u64 = 8 << 10;
const _: () = assert!(2 * NOISE <= GRAD_BYTES && GRAD_BYTES <= VALUE_BYTES);

fn weight(seed: u64) -> Var {
    let v = remat::rng::RngKey::named(seed, "w").normal(WIDTH * WIDTH, 0.0, 0.3);
    Var::from_tensor(&Tensor::from_vec(v, (WIDTH, WIDTH), &Device::Cpu).unwrap()).unwrap()
}

/// Stages 0-7: e1, e2 (down), e3 (down), bottom, d3(bottom + e3), d2(d3 + e2), d1(d2 + e1; e1's
/// weight), loss. Every skip is read by the next stage and by a decoder stage, so depending on the
/// cuts it is stored for a later segment, read twice in the segment that takes it over (Rule 5),
/// or read both in its producer's segment and a later one.
fn graph(ws: &[Var]) -> StageGraph {
    let dense = |w: usize, kind| Dense { w: ws[w].as_tensor().clone(), kind };
    let mut g = StageGraph::new(1);
    let e1 = g.then(dense(0, StageKind::Block), 0).unwrap();
    let e2 = g.then(dense(1, StageKind::DownsampleBlock), e1).unwrap();
    let e3 = g.then(dense(2, StageKind::DownsampleBlock), e2).unwrap();
    let bottom = g.then(dense(3, StageKind::Block), e3).unwrap();
    let d3 = g.add(dense(4, StageKind::Block), &[bottom, e3], 1).unwrap()[0];
    let d2 = g.add(dense(5, StageKind::Block), &[d3, e2], 1).unwrap()[0];
    let d1 = g.add(dense(0, StageKind::Block), &[d2, e1], 1).unwrap()[0];
    let loss = g.then(SquaredSum, d1).unwrap();
    g.set_output(loss);
    g
}

#[test]
fn the_planner_replays_the_executors_bookkeeping_event_by_event() {
    let ws: Vec<Var> = (0..6).map(weight).collect();
    let g = graph(&ws);
    let x = Tensor::from_vec(
        remat::rng::RngKey::named(9, "x").normal(BATCH * WIDTH, 0.0, 1.0),
        (BATCH, WIDTH),
        &Device::Cpu,
    )
    .unwrap();
    let inputs = [x];
    let profile =
        Profile::at_batch(&g, |_| Ok::<_, String>(inputs.to_vec()), &ws, BATCH, SEED).unwrap();
    let (activations, _loss) = profile.values.split_at(profile.values.len() - 1);
    assert!(activations.iter().all(|v| v.bytes == VALUE_BYTES));
    let dense = &profile.stages[..7];
    assert!(
        dense.iter().all(|s| s.keepable.len() == 1 && s.keepable[0].bytes == VALUE_BYTES),
        "each dense stage has one keepable product"
    );
    assert_eq!(
        profile.shared_grads.iter().map(|s| (s.first, s.last)).collect::<Vec<_>>(),
        [(0, 6)],
        "the weight e1 and d1 share"
    );
    for policy in [
        "off",
        "sqrt",
        "every-n=2",
        "explicit=1,5",
        "before-downsample",
        "plan=1",
        "plan=2,5",
        "sqrt+keep=matmul",
        "plan=2,5+keep=matmul",
        "off+units=2",
        "off+units=8",
        "sqrt+units=2",
        "plan=2,5+units=2,3,1",
        "plan=2,5+keep=matmul+units=3",
    ] {
        let policy = policy.parse::<Policy>().unwrap();
        let exec = Executor::new(&g, &policy, ws.clone(), SEED).unwrap();
        let cut = (exec.segments(), exec.units(), policy.keeps());
        let (segments, policy) = (&cut.0, policy.to_string());
        assert_eq!(
            exec.stored_values(),
            remat::plan::stored_values(&profile, segments),
            "{policy}: stored values (Rule 1)"
        );

        exec.step(&inputs, 0).unwrap(); // thread pools and kernel workspaces are not the step's
        let base = heap_current();
        let events = exec.step(&inputs, 1).unwrap().timeline.events;
        replays(&policy, &profile, &cut, Grads::Gathered, &events, base);

        // Accumulating: the second micro-batch, on the first's gradients (Rule 8's partial sums).
        let base = heap_current();
        let first = exec.step(&inputs, 2).unwrap().grads;
        let events = exec.accumulate(&inputs, 3, first).unwrap().timeline.events;
        replays(
            &format!("{policy}, accumulating"),
            &profile,
            &cut,
            Grads::Accumulating(profile.param_grad_bytes()),
            &events,
            base,
        );

        // The optimizer inside backward: every gradient dropped as soon as it is reported complete.
        let base = heap_current();
        let mut free = |ready: &[usize], store: &mut GradStore| {
            ready.iter().for_each(|&k| drop(store.remove(exec.params()[k].as_tensor())));
            Ok(())
        };
        let events = exec
            .accumulate_reporting(&inputs, 4, GradStore::default(), &mut free)
            .unwrap()
            .timeline
            .events;
        replays(
            &format!("{policy}, optimizer inside backward"),
            &profile,
            &cut,
            Grads::UpdatedInBackward,
            &events,
            base,
        );
    }
}

/// The executor's `events` of a step cut into segments run backward in units, keeping the ops of
/// a set (`cut`), against
/// the planner's replay, with what the step does with parameter `grads`; `base`: the heap
/// before those.
fn replays(
    at: &str,
    profile: &Profile,
    (segments, units, keep): &(Vec<std::ops::Range<usize>>, Vec<usize>, OpSet),
    grads: Grads,
    events: &[Event],
    base: u64,
) {
    let predicted = profile.timeline(segments, units, *keep, grads);
    let estimate = profile.predict(segments, units, *keep, grads);
    assert_eq!(
        predicted.iter().map(|p| p.peak.total()).max(),
        Some(estimate.peak),
        "{at}: the estimate is the timeline's highest point"
    );
    let order = |e: &[(remat::memory::Phase, usize)]| {
        e.iter().map(|(p, s)| format!("{p:?} {s}")).collect::<Vec<_>>()
    };
    let (ran, replayed): (Vec<_>, Vec<_>) = (
        events.iter().map(|e| (e.phase, e.stage)).collect(),
        predicted.iter().map(|p| (p.phase, p.stage)).collect(),
    );
    assert_eq!(order(&ran), order(&replayed), "{at}: events (Rule 3)");
    for (event, point) in events.iter().zip(&predicted) {
        agree(&format!("{at}, {:?} of stage {}", event.phase, event.stage), event, point, base);
    }
    let measured = events.iter().map(|e| e.window_peak).max().unwrap() - base;
    let error = estimate.peak as f64 / measured as f64 - 1.0;
    eprintln!(
        "{at}: step peak predicted {}, measured {measured} ({:+.2}%)",
        estimate.peak,
        error * 100.0
    );
    assert!(
        error.abs() <= 0.03,
        "{at}: step peak predicted {}, measured {measured} ({:+.1}%)",
        estimate.peak,
        error * 100.0
    );
}

/// One event against its predicted point; `base`: the heap before the step.
fn agree(at: &str, event: &Event, point: &Point, base: u64) {
    let held_grads = event.grad_bytes / GRAD_BYTES;
    assert_eq!(
        point.held.param_grads,
        event.grad_bytes + held_grads * tensor_overhead(),
        "{at}: parameter gradients (Rule 8)"
    );
    let (measured, predicted) = (event.bytes - base, point.held.total());
    assert!(
        measured.abs_diff(predicted) <= NOISE,
        "{at}: the executor holds {measured} B, the planner predicts {predicted} B ({:+} B: {:?})",
        measured as i64 - predicted as i64,
        point.held
    );
}
