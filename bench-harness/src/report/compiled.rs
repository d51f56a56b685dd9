//! Compiled PyTorch beside ours in `matrix.md` and `TABLE.md`: at each memory level inductor's
//! budget sweep reached, the fastest of our configurations and of eager PyTorch's that hold no
//! more.
//!
//! The experiment's other layers: [`crate::run::baseline`] (`Measure::Compiled`, one compiled run
//! per budget) and [`crate::run::matrix`] (the sweep after each model's configurations).

use super::record::{Baseline, Record, Status};
use super::results::Matrix;
use super::units::mib;
use std::fmt::Write as _;

/// Per compiled run, as Markdown (empty without compiled runs): its step peak, time and compile
/// time, and the fastest of our measured configurations and of the eager baselines of its model
/// whose step peak is at most its own.
pub fn at_its_memory_levels(m: &Matrix) -> String {
    if m.compiled.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "\n## Against compiled PyTorch\n\nEach model's whole step through `torch.compile` \
         (inductor, compiled from scratch; `--baseline pytorch-compile`) at activation memory \
         budgets from 1.0 to 0.1 (`torch._functorch.config.activation_memory_budget`: the share \
         of the activations its partitioner may keep; below 1 it recomputes the cheapest), on the \
         model, batch and input of our `off`. At each of its memory levels: the fastest of our \
         measured configurations, and of PyTorch eager's (`torch.utils.checkpoint` on our \
         segments), whose step peak is at most the compiled step's; *ours / compiled time* is the \
         median (range) over the measuring runs and the interleaved timing rounds, where the \
         compiled runs are timed after our policies and eager's in each round. Compile time is \
         the first step's beyond a step's, out of the step time. {}.\n\n| model | budget | \
         compiled: step peak | compiled: step time | compile time | ours at that memory | ours / \
         compiled time | eager at that memory |\n|---|---|---|---|---|---|---|---|\n",
        super::results::made_by(m.compiled.iter().map(|b| b.command.as_str()), &m.meta.command)
    );
    for c in &m.compiled {
        let budget = c.memory_budget.map_or_else(|| c.policy.clone(), |b| format!("{b}"));
        if c.status != Status::Ok {
            let error = c.error.replace('|', "/");
            let _ = writeln!(out, "| {} | {budget} | {}: {error} | | | | | |", c.model, c.status);
            continue;
        }
        let ours =
            ours_within(m, c).map(|r| (r.step_peak_bytes, r.step_ms_median, r.policy.as_str()));
        let eager = fastest_within(
            m.baselines.iter().filter(|b| b.model == c.model && b.status == Status::Ok),
            c.step_peak_bytes,
            |b: &Baseline| (b.step_peak_bytes, b.step_ms_median, b.policy.as_str()),
        );
        let level = |best: Option<(u64, f64, &str)>| {
            best.map_or("none at or below it".into(), |(peak, ms, policy)| {
                format!("`{policy}`: {}, {ms:.0} ms", mib(peak))
            })
        };
        // Over the interleaved rounds where they ran, else of the measuring runs.
        let ratio = match (&c.ours_over_torch, ours) {
            (Some(s), Some(_)) => format!("{:.2}x ({:.2}-{:.2})", s.median, s.min, s.max),
            (None, Some((_, ms, _))) => format!("{:.2}x", ms / c.step_ms_median),
            (_, None) => "-".into(),
        };
        let _ = writeln!(
            out,
            "| {} | {budget} | {} | {:.0} ms | {:.0} s | {} | {ratio} | {} |",
            c.model,
            mib(c.step_peak_bytes),
            c.step_ms_median,
            c.compile_ms.unwrap_or(0.0) / 1e3,
            level(ours),
            level(eager),
        );
    }
    out
}

/// Our fastest measured configuration of the compiled run `c`'s model whose step peak is at most
/// its own.
pub fn ours_within<'a>(m: &'a Matrix, c: &Baseline) -> Option<&'a Record> {
    m.records
        .iter()
        .filter(|r| r.model == c.model && r.status == Status::Ok)
        .filter(|r| r.step_peak_bytes <= c.step_peak_bytes)
        .min_by(|a, b| a.step_ms_median.total_cmp(&b.step_ms_median))
}

/// The fastest of `runs` (as step peak, step time, policy) whose step peak is at most `peak`.
fn fastest_within<'a, T: 'a>(
    runs: impl Iterator<Item = &'a T>,
    peak: u64,
    of: impl Fn(&'a T) -> (u64, f64, &'a str),
) -> Option<(u64, f64, &'a str)> {
    runs.map(of).filter(|&(p, _, _)| p <= peak).min_by(|a, b| a.1.total_cmp(&b.1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::record::Spread;

    /// At a compiled run's memory level, the fastest of ours and of eager's that fit are named;
    /// where none fits, it says so; a failed compile shows its error; timed in rounds, the ratio
    /// is theirs.
    #[test]
    fn the_fastest_at_each_compiled_memory_level() {
        let rec = |policy: &str, peak: u64, ms: f64| Record {
            model: "m".into(),
            policy: policy.into(),
            step_peak_bytes: peak << 20,
            step_ms_median: ms,
            status: Status::Ok,
            ..Record::default()
        };
        let run = |framework: &str, policy: &str, peak: u64, ms: f64| Baseline {
            framework: framework.into(),
            model: "m".into(),
            policy: policy.into(),
            step_peak_bytes: peak << 20,
            step_ms_median: ms,
            memory_budget: (framework == "pytorch-compile").then_some(0.5),
            compile_ms: Some(30e3),
            status: Status::Ok,
            ..Baseline::default()
        };
        let failed = Baseline {
            status: Status::Error,
            error: "BackendCompilerFailed".into(),
            ..run("pytorch-compile", "memory-budget=0.1", 0, 0.0)
        };
        let m = Matrix {
            records: vec![
                rec("off", 130, 500.0),
                rec("sqrt", 100, 600.0),
                rec("plan=3", 110, 550.0),
            ],
            baselines: vec![run("pytorch", "off", 140, 400.0), run("pytorch", "sqrt", 95, 480.0)],
            compiled: vec![
                run("pytorch-compile", "memory-budget=0.5", 112, 420.0),
                run("pytorch-compile", "memory-budget=0.5", 90, 450.0),
                failed,
                Baseline {
                    ours_over_torch: Spread::of(vec![1.3, 1.1, 1.2]),
                    ..run("pytorch-compile", "memory-budget=0.7", 120, 400.0)
                },
            ],
            ..Matrix::default()
        };
        let table = at_its_memory_levels(&m);
        let rows: Vec<&str> = table.lines().filter(|l| l.starts_with("| m |")).collect();
        assert!(rows[0].contains("`plan=3`: 110.0 MiB, 550 ms | 1.31x"), "{}", rows[0]);
        assert!(rows[0].contains("`sqrt`: 95.0 MiB, 480 ms"), "{}", rows[0]);
        assert_eq!(rows[1].matches("none at or below it").count(), 2, "{}", rows[1]);
        assert!(rows[2].contains("error: BackendCompilerFailed"), "{}", rows[2]);
        assert!(
            rows[3].contains("`plan=3`: 110.0 MiB, 550 ms | 1.20x (1.10-1.30) |"),
            "{}",
            rows[3]
        );
        assert_eq!(at_its_memory_levels(&Matrix::default()), "");
    }
}
