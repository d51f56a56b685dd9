//! `--rounds` and `--retime`: every policy of a model timed again in interleaved rounds, each in a
//! fresh process, PyTorch right after ours where it runs beside, its compiled runs after the
//! policies, and the ratios over the rounds (time / off, ours / PyTorch) stored in the records;
//! with `--retime`, their times too.
//!
//! Its other layers: [`crate::measure::one`] (`One::TimeOnly`: the steps timed, nothing else) and
//! [`crate::report::record`] (`Spread`: a ratio over the rounds). Not here: the measuring run
//! ([`super::matrix`]).

use super::baseline::{self, Measure};
use super::child::spawn_one;
use crate::cli::Common;
use crate::measure::One;
use crate::report::record::{Spread, Status};
use crate::report::results::{this_command, Matrix};
use crate::workloads::{Profile, Workload};
use remat::{Policy, PolicyRequest};

/// How many timing rounds, and whether their times replace the measuring run's (`--retime`)
/// instead of joining them.
#[derive(Clone, Copy)]
pub(super) struct Timing {
    pub(super) rounds: usize,
    pub(super) replace: bool,
}

/// Times every policy of `w` again, `rounds` times interleaved (off, p1, p2, ..., off, p1, ...),
/// each in a fresh process, and records each policy's time / off per round beside the ratio of
/// the measuring run: run-to-run drift then shows as a spread instead of a wrong ratio. With
/// `python`, PyTorch runs each policy right after ours (off, PyTorch off, p1, PyTorch p1, ...), and
/// its baseline gets our time over its time per pair, and its own time / off, the same way; the
/// model's compiled runs (`--baseline pytorch-compile`) are timed after the policies in each
/// round, and each gets the time of our fastest configuration within its memory over its own, per
/// round. `replace`: the measuring run's times are left out, and each record's and baseline's
/// step time becomes the rounds' (median, range), with this command named as the times' maker.
pub(super) fn time_rounds(
    matrix: &mut Matrix,
    w: &Workload,
    policies: &[PolicyRequest],
    timing: Timing,
    common: &Common,
    profile: Profile,
    python: Option<&str>,
) {
    let off = PolicyRequest::Fixed(Policy::Off);
    let ok = |m: &Matrix, p: &PolicyRequest| {
        m.find(&w.model, &p.to_string()).is_some_and(|r| r.status == Status::Ok)
    };
    // Without `off` there is no ratio to take; a retime still replaces the times (a model whose
    // `off` does not fit this machine keeps its checkpointed policies' times and PyTorch's).
    if !ok(matrix, &off) && !timing.replace {
        return;
    }
    let timed: Vec<&PolicyRequest> = policies.iter().filter(|p| ok(matrix, p)).collect();
    let torch = python.filter(|_| baseline::MODELS.contains(&w.model.as_str()));
    // Per policy: ours, and PyTorch's where it ran, step times per round, the measuring runs first.
    let theirs = |m: &Matrix, p: &PolicyRequest| torch_step_ms(m, &w.model, p);
    let first = |t: Option<f64>| if timing.replace { vec![] } else { vec![t] };
    let mut ours: Vec<Vec<Option<f64>>> = timed
        .iter()
        .map(|p| first(matrix.find(&w.model, &p.to_string()).map(|r| r.step_ms_median)))
        .collect();
    let mut torch_ms: Vec<Vec<Option<f64>>> =
        timed.iter().map(|p| first(theirs(matrix, p))).collect();
    let torch_ran: Vec<bool> = timed.iter().map(|p| theirs(matrix, p).is_some()).collect();
    // The model's compiled runs that ran, each timed again from `off`'s configuration.
    let compiled: Vec<(f64, f64)> = match (torch, matrix.find(&w.model, "off")) {
        (Some(_), Some(off)) if off.status == Status::Ok => matrix
            .compiled
            .iter()
            .filter(|c| c.model == w.model && c.status == Status::Ok)
            .filter_map(|c| Some((c.memory_budget?, c.step_ms_median)))
            .collect(),
        _ => Vec::new(),
    };
    let mut compiled_ms: Vec<Vec<Option<f64>>> =
        compiled.iter().map(|&(_, ms)| first(Some(ms))).collect();
    for round in 1..=timing.rounds {
        for (i, p) in timed.iter().enumerate() {
            let rec = spawn_one(w, p, common, (profile, None), One::TimeOnly);
            // A line per configuration and round: a long --retime says where it is, on a
            // terminal or not (the progress bar is drawn on a terminal only).
            trainkit::say!(
                "timing round {round}/{}: {} {p}: {}",
                timing.rounds,
                w.model,
                outcome(&rec.status, rec.step_ms_median)
            );
            ours[i].push(Some(rec.step_ms_median).filter(|_| rec.status == Status::Ok));
            let measured = matrix.find(&w.model, &p.to_string()).unwrap();
            let b = torch.filter(|_| torch_ran[i]).map(|py| {
                let (steps, seed) = (common.steps, common.seed);
                baseline::run(py, measured, w.input_size, steps, seed, Measure::TimeOnly, None)
            });
            torch_ms[i].push(b.filter(|b| b.status == Status::Ok).map(|b| b.step_ms_median));
        }
        for (j, &(budget, _)) in compiled.iter().enumerate() {
            let py = torch.expect("compiled runs only beside PyTorch");
            let off = matrix.find(&w.model, "off").expect("compiled runs only where off ran");
            let measure = Measure::CompiledTimeOnly(budget);
            let b = baseline::run(py, off, w.input_size, common.steps, common.seed, measure, None);
            trainkit::say!(
                "timing round {round}/{}: {} compiled, {}: {}",
                timing.rounds,
                w.model,
                baseline::compiled_policy(budget),
                outcome(&b.status, b.step_ms_median)
            );
            compiled_ms[j].push(Some(b.step_ms_median).filter(|_| b.status == Status::Ok));
        }
    }
    let rounds = Rounds { ours, torch: torch_ms };
    store_rounds(matrix, w, &timed, &rounds, timing.replace);
    let budgets = compiled.iter().map(|&(budget, _)| budget);
    store_compiled_rounds(
        matrix,
        w,
        &timed,
        &rounds.ours,
        budgets.zip(compiled_ms),
        timing.replace,
    );
}

/// Whether `model`'s configurations under `policies` lack what timing rounds give them (they
/// are stored after the last round): a policy's time / off where it and `off` ran, or, `torch`,
/// ours / PyTorch where PyTorch ran.
pub(super) fn rounds_missing(
    m: &Matrix,
    model: &str,
    policies: &[PolicyRequest],
    torch: bool,
) -> bool {
    let off_ran = m.find(model, "off").is_some_and(|r| r.status == Status::Ok);
    policies.iter().map(ToString::to_string).any(|p| {
        let ratio_missing = m.find(model, &p).is_some_and(|r| {
            off_ran && p != "off" && r.status == Status::Ok && r.time_vs_off.is_none()
        });
        let torch_missing = m
            .find_baseline(model, &p)
            .is_some_and(|b| torch && b.status == Status::Ok && b.ours_over_torch.is_none());
        ratio_missing || torch_missing
    })
}

/// PyTorch's step time of `model` under `policy`, where its baseline in `m` ran.
fn torch_step_ms(m: &Matrix, model: &str, policy: &PolicyRequest) -> Option<f64> {
    m.find_baseline(model, &policy.to_string())
        .filter(|b| b.status == Status::Ok)
        .map(|b| b.step_ms_median)
}

/// Step times per timing round, per timed policy (the measuring run's first unless replaced):
/// ours, and PyTorch's where it ran.
struct Rounds {
    ours: Vec<Vec<Option<f64>>>,
    torch: Vec<Vec<Option<f64>>>,
}

/// The ratios of [`time_rounds`] into each timed policy's record and baseline; with `replace`,
/// their step times too.
fn store_rounds(
    matrix: &mut Matrix,
    w: &Workload,
    timed: &[&PolicyRequest],
    rounds: &Rounds,
    replace: bool,
) {
    let off = PolicyRequest::Fixed(Policy::Off);
    let theirs = |m: &Matrix, p: &PolicyRequest| torch_step_ms(m, &w.model, p);
    // `off`'s times per round; only its measuring run's where this run's policies leave it out
    // (a resumed folder holds it), so the ratios are that pair's alone.
    let (ours_off, torch_off) = match timed.iter().position(|p| **p == off) {
        Some(i) => (rounds.ours[i].clone(), rounds.torch[i].clone()),
        None => (
            vec![matrix
                .find(&w.model, "off")
                .filter(|r| r.status == Status::Ok)
                .map(|r| r.step_ms_median)],
            vec![theirs(matrix, &off)],
        ),
    };
    for (i, p) in timed.iter().enumerate() {
        let mut rec = matrix.find(&w.model, &p.to_string()).unwrap().clone();
        if **p != off {
            rec.time_vs_off = Spread::of(ratios(&rounds.ours[i], &ours_off));
        }
        if replace {
            if let Some(t) = Spread::of(rounds.ours[i].iter().flatten().copied().collect()) {
                (rec.step_ms_median, rec.step_ms_min, rec.step_ms_max) = (t.median, t.min, t.max);
                rec.times_command = this_command();
            }
        }
        matrix.put(rec);
        if let Some(mut b) = matrix
            .find_baseline(&w.model, &p.to_string())
            .filter(|b| b.status == Status::Ok)
            .cloned()
        {
            b.ours_over_torch = Spread::of(ratios(&rounds.ours[i], &rounds.torch[i]));
            b.time_vs_off =
                if **p == off { None } else { Spread::of(ratios(&rounds.torch[i], &torch_off)) };
            if replace {
                if let Some(t) = Spread::of(rounds.torch[i].iter().flatten().copied().collect()) {
                    (b.step_ms_median, b.step_ms_min, b.step_ms_max) = (t.median, t.min, t.max);
                    b.times_command = this_command();
                }
            }
            matrix.put_baseline(b);
        }
    }
}

/// A timed run's line: its step time, or how it ended.
fn outcome(status: &Status, step_ms: f64) -> String {
    if *status == Status::Ok {
        format!("{step_ms:.0} ms")
    } else {
        status.to_string()
    }
}

/// a[k] / b[k] for every round k where both ran.
fn ratios(a: &[Option<f64>], b: &[Option<f64>]) -> Vec<f64> {
    a.iter().zip(b).filter_map(|(a, b)| Some((*a)? / (*b)?)).collect()
}

/// Each compiled run's times over the rounds (`runs`: its budget and step time per round) into
/// its record: our fastest configuration whose step peak is at most its own (the report's
/// `ours_within`), where this run timed it, over its time, per round; with `replace`, its step
/// time too.
fn store_compiled_rounds(
    matrix: &mut Matrix,
    w: &Workload,
    timed: &[&PolicyRequest],
    ours: &[Vec<Option<f64>>],
    runs: impl Iterator<Item = (f64, Vec<Option<f64>>)>,
    replace: bool,
) {
    for (budget, times) in runs {
        let policy = baseline::compiled_policy(budget);
        let Some(mut c) = matrix.find_compiled(&w.model, &policy).cloned() else { continue };
        // The configuration the report names at this memory level, where this run timed it.
        let within = crate::report::compiled::ours_within(matrix, &c)
            .and_then(|r| timed.iter().position(|p| p.to_string() == r.policy));
        c.ours_over_torch = within.and_then(|i| Spread::of(ratios(&ours[i], &times)));
        if replace {
            if let Some(t) = Spread::of(times.iter().flatten().copied().collect()) {
                (c.step_ms_median, c.step_ms_min, c.step_ms_max) = (t.median, t.min, t.max);
                c.times_command = this_command();
            }
        }
        matrix.put_compiled(c);
    }
}
