//! PyTorch beside ours in `matrix.md`: step peaks and times side by side, and the rates the
//! convolutions and products achieve.
//!
//! The experiment's other layers: [`crate::run::baseline`] (PyTorch run on one configuration,
//! `scripts/torch_baseline.py`) and [`crate::run::matrix`] (when it runs: right after ours, and in
//! the timing rounds); the script measures, so no `measure` module.

use super::record::{Baseline, Record, Status};
use super::results::Matrix;
use super::units::mib;
use std::fmt::Write as _;

/// Ours against PyTorch, configuration by configuration, as Markdown (empty without
/// baselines): step peak above model state and step time, and each side's time / off.
pub fn side_by_side(m: &Matrix) -> String {
    if m.baselines.is_empty() {
        return String::new();
    }
    let version = m
        .baselines
        .iter()
        .find(|b| !b.framework_version.is_empty())
        .map_or("", |b| b.framework_version.as_str());
    let mut out = format!(
        "\n## Side by side with PyTorch {version}\n\nThe same configurations in PyTorch eager on \
         the same machine, run right after ours (`--baseline pytorch`: \
         `scripts/torch_baseline.py`, torchvision/transformers models, \
         `torch.utils.checkpoint(use_reentrant=False)` on the same segments, the same optimizer, \
         fp32, the same thread count). *Step peak*: the highest live bytes during a step above the \
         model state (parameters + optimizer state), ours from the counting allocator, PyTorch's \
         from its profiler's allocation events. Times are medians of the timed steps after a \
         warm-up; the time ratios are medians (range) over the measuring pair and the interleaved \
         timing rounds, where PyTorch runs each policy right after ours. PyTorch's side: {}.\n\n| \
         model | policy | step peak: ours | step peak: PyTorch | ours / PyTorch | step time: ours \
         | step time: PyTorch | ours / PyTorch | time / off: ours | time / off: PyTorch \
         |\n|---|---|---|---|---|---|---|---|---|---|\n",
        super::results::made_by(m.baselines.iter().map(|b| b.command.as_str()), &m.meta.command)
    );
    for b in &m.baselines {
        let Some(r) = m.find(&b.model, &b.policy).filter(|r| r.status == Status::Ok) else {
            continue;
        };
        if b.status != Status::Ok {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {}: {} | | {:.0} ms | | | | |",
                b.model,
                b.policy,
                mib(r.step_peak_bytes),
                b.status,
                b.error.replace('|', "/"),
                r.step_ms_median
            );
            continue;
        }
        let spread =
            |t: &super::record::Spread| format!("{:.2}x ({:.2}-{:.2})", t.median, t.min, t.max);
        let ours_vs_off = r.time_vs_off.as_ref().map_or("-".into(), spread);
        let torch_vs_off = match &b.time_vs_off {
            Some(t) => spread(t),
            None => m
                .find_baseline(&b.model, "off")
                .filter(|o| o.status == Status::Ok && b.policy != "off")
                .map_or("-".into(), |o| format!("{:.2}x", b.step_ms_median / o.step_ms_median)),
        };
        let time_ratio = b
            .ours_over_torch
            .as_ref()
            .map_or_else(|| format!("{:.2}x", r.step_ms_median / b.step_ms_median), spread);
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.2}x | {:.0} ms | {:.0} ms | {time_ratio} | {ours_vs_off} | \
             {torch_vs_off} |",
            b.model,
            b.policy,
            mib(r.step_peak_bytes),
            mib(b.step_peak_bytes),
            r.step_peak_bytes as f64 / b.step_peak_bytes.max(1) as f64,
            r.step_ms_median,
            b.step_ms_median,
        );
    }
    out + &rates(m)
}

/// Achieved GFLOP/s per configuration, ours and PyTorch's, against the machine's best (empty
/// where no baseline counted its FLOPs). A model's step FLOPs are its `off` baseline's count.
fn rates(m: &Matrix) -> String {
    let flops = |model: &str| m.find_baseline(model, "off").and_then(|o| o.step_flops);
    let rows: Vec<(&Baseline, &Record, u64)> = m
        .baselines
        .iter()
        .filter(|b| b.status == Status::Ok)
        .filter_map(|b| {
            Some((
                b,
                m.find(&b.model, &b.policy).filter(|r| r.status == Status::Ok)?,
                flops(&b.model)?,
            ))
        })
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    let torch_peak = m.baselines.iter().filter_map(|b| b.mm_peak_gflops).reduce(f64::max);
    let peak = [m.meta.matmul_peak_gflops, torch_peak].into_iter().flatten().reduce(f64::max);
    let rate = |p: Option<f64>| p.map_or("not measured".into(), |p| format!("{p:.0}"));
    let mut out = format!(
        "\n## Achieved GFLOP/s\n\nA step's FLOPs (forward and backward without recompute, as \
         PyTorch's `FlopCounterMode` counts them from the shapes of the products and convolutions \
         of the same model) over the median step time: under a checkpointing policy the recompute \
         is work on top, so this is the useful rate. {}\n\n| model | policy | step GFLOP | ours \
         GFLOP/s | PyTorch GFLOP/s | ours, of the best | PyTorch, of the best \
         |\n|---|---|---|---|---|---|---|\n",
        peak.map_or("The machine's best was not measured in this run.".into(), |p| format!(
            "*The best*: {p:.0} GFLOP/s, the faster of the two frameworks' (2048, 2048) @ (2048, \
             2048) f32 products on the same threads (ours, gemm: {}; PyTorch's torch.mm: {}), each \
             the fastest of five, measured in this run.",
            rate(m.meta.matmul_peak_gflops),
            rate(torch_peak)
        ))
    );
    for (b, r, flops) in rows {
        let (ours, torch) =
            (flops as f64 / r.step_ms_median / 1e6, flops as f64 / b.step_ms_median / 1e6);
        let share = |rate: f64| peak.map_or("-".into(), |p| format!("{:.0}%", 100.0 * rate / p));
        let _ = writeln!(
            out,
            "| {} | {} | {:.1} | {ours:.1} | {torch:.1} | {} | {} |",
            b.model,
            b.policy,
            flops as f64 / 1e9,
            share(ours),
            share(torch)
        );
    }
    out
}
