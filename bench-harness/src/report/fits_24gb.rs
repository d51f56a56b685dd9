//! The `gpt2-24gb` matrix's table (`TABLE.md`) and figure: for GPT-2 at every published size,
//! batch 1 with 8 micro-batches accumulated (one with the optimizer inside backward), each way of
//! holding its state and each policy: the predicted bytes (with the state's arithmetic), the
//! measured peak, whether it fits 24 GiB, and tokens per second.
//!
//! The experiment's other layers: [`crate::run::gpt2_24gb`] (its defaults, the prediction, the
//! skip) and [`crate::measure::projection`] (the projection the predictions come from).

use super::plot::{self, color, plot_err, Chart};
use super::record::{Prediction, Record, Status};
use super::results::Matrix;
use super::units;
use crate::workloads::{Profile, CARD_BYTES, IN_BACKWARD};
use anyhow::Result;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::fmt::Write as _;
use std::path::Path;

/// The sequence and the micro-batches of the matrix's configurations, in words: "seq 1024, 2
/// micro-batches accumulated per optimizer step (1 with the optimizer inside backward)".
fn sizes(m: &Matrix) -> String {
    let input = m.records.first().map_or("?", |r| r.input.as_str());
    let inside = |r: &&Record| r.model.ends_with(IN_BACKWARD);
    let accumulated = m.records.iter().find(|r| !inside(r)).map(|r| r.accumulate);
    let in_backward = m.records.iter().any(|r| inside(&r));
    match (accumulated, in_backward) {
        (Some(1), _) => format!("{input}, one micro-batch per optimizer step"),
        (Some(n), true) => format!(
            "{input}, {n} micro-batches accumulated per optimizer step (1 with the optimizer \
             inside backward)"
        ),
        (Some(n), false) => format!("{input}, {n} micro-batches accumulated per optimizer step"),
        (None, _) => format!("{input}, one micro-batch per step, the optimizer inside backward"),
    }
}

/// Bytes as a table cell: GiB with two decimals.
fn cell(bytes: u64) -> String {
    format!("{:.2}", units::gib(bytes))
}

/// The records smallest model first (within a size, in the matrix's order: variant, then policy),
/// whatever order the runs that made them came in.
pub fn in_size_order(m: &Matrix) -> Vec<&Record> {
    const SIZES: [&str; 4] = ["gpt2-small/", "gpt2-medium/", "gpt2-large/", "gpt2-xl/"];
    let mut records: Vec<&Record> = m.records.iter().collect();
    records.sort_by_key(|r| SIZES.iter().position(|s| r.model.starts_with(s)));
    records
}

/// Whether a configuration fits 24 GiB, in words.
fn fits(r: &Record) -> String {
    match (r.status, r.predicted_total_bytes) {
        (Status::Ok, _) => if r.measured_total() <= CARD_BYTES { "**yes**" } else { "no" }.into(),
        // The kernel, not the cap: the process's resident memory outgrew the machine.
        (Status::Oom, p) if r.error.contains("SIGKILL") => {
            format!(
                "not measured: killed by the kernel (this machine's memory){}",
                p.map_or(String::new(), |p| format!("; predicted {} GiB", cell(p)))
            )
        }
        (Status::Oom, _) => "no (out of memory under the cap)".into(),
        (Status::Skipped, Some(p)) if p <= CARD_BYTES => "predicted yes".into(),
        (Status::Skipped, _) => "no (predicted)".into(),
        (Status::Error, _) => format!("error: {}", r.error),
    }
}

/// Whether `r` was measured with freed memory given back at once: every step faulted its pages
/// in again, so its time is not the other rows' kind.
fn returned_freed_memory(r: &Record) -> bool {
    r.command.contains("--return-freed-memory")
}

fn state_row(r: &Record, model: &str, variant: &str, p: &Prediction) -> String {
    let bytes =
        r.dtype.parse::<trainable::Precision>().map_or(4, |d| d.weights().size_in_bytes() as u64);
    let params = p.params / bytes;
    let per_rank = |ranks: u64| cell(p.params + p.grads + p.optimizer.div_ceil(ranks));
    format!(
        "| {model} | {variant} | {params} | {} | {} | {} | {} | {} | {} |",
        cell(p.params),
        cell(p.grads),
        cell(p.optimizer),
        cell(p.state()),
        per_rank(2),
        per_rank(4)
    )
}

/// `TABLE.md`.
pub fn table(m: &Matrix, _profile: Profile) -> String {
    let meta = &m.meta;
    let mut out = format!(
        "# GPT-2 on 24 GiB: state, precision, optimizer and checkpointing, \
         measured\n\n{}  \nMachine: {}  \ncandle {}, commit {}, profile `{}`\n\nEvery \
         configuration trains at batch 1, {}. Variants: `f32-adamw` (everything f32), `bf16-adamw` \
         (bf16 activations, f32 parameters, gradients and AdamW moments), `bf16-weights-adamw` \
         (bf16 activations, parameters and gradients, f32 AdamW moments: no f32 master copy), \
         `bf16-adafactor` (bf16 activations, f32 parameters and gradients, Adafactor's factored \
         second moment), `{IN_BACKWARD}` (`f32-adamw` with the optimizer inside backward: each \
         gradient applied and freed as soon as it is final, one micro-batch per step).\n\n",
        super::results::made_by(m.records.iter().map(|r| r.command.as_str()), &meta.command),
        meta.machine,
        meta.candle_version,
        meta.git_commit,
        meta.profile,
        sizes(m)
    );
    out += "## The model state, by arithmetic\n\nParameters and gradients 4 bytes each (2 under \
        `bf16-weights-adamw`); AdamW 8 bytes per parameter; Adafactor 4 bytes per row and per \
        column of each weight matrix (per element of a vector). Computed from the parameter \
        shapes, not measured. The last two columns are one rank's state when the optimizer state \
        is sharded over 2 or 4 data-parallel ranks (`--ranks N --shard-optimizer`, ZeRO stage 1: \
        every rank still holds all parameters and gradients). With the optimizer inside backward \
        no gradient is held through the step: the ones in flight are part of the step's peak, with \
        the activations.\n\n| model | variant | parameters | params GiB | grads GiB | optimizer \
        GiB | state GiB | per rank, sharded over 2 | over 4 \
        |\n|---|---|---|---|---|---|---|---|---|\n";
    let records = in_size_order(m);
    let mut seen = Vec::new();
    for r in &records {
        let (Some(p), Some((model, variant))) = (r.predicted, r.model.split_once('/')) else {
            continue;
        };
        if !seen.contains(&r.model) {
            seen.push(r.model.clone());
            let _ = writeln!(out, "{}", state_row(r, model, variant, &p));
        }
    }
    out += "\n## Predicted against measured\n\nPredicted total: the planner's, from the model \
        built at its size and its stages profiled one at a time at batch 1 and the full sequence \
        (one block measured, its figures reused for the others, which are alike), the optimizer \
        state by arithmetic. Measured total: the heap before the step (parameters, optimizer \
        state) plus the step's peak above it (gradients, activations), the highest over the timed \
        steps. Configurations predicted above the memory cap are not run; with `--dry-run`, none \
        is, and every row is a prediction. The meter counts live bytes; the allocator keeps freed \
        pages for reuse (a step faults in no new memory), so a process's resident memory runs \
        above its live heap (by 3-4 GiB for GPT-2 XL): near a machine's limit the kernel may kill \
        a run whose live heap fits, which the table says.\n\n| model | variant | policy | \
        predicted GiB | measured GiB | error | fits 24 GiB | tokens/s | step time | gradients \
        |\n|---|---|---|---|---|---|---|---|---|---|\n";
    for r in &records {
        let _ = writeln!(out, "{}", measured_row(r));
    }
    let fit: Vec<String> = records
        .iter()
        .filter(|r| r.status == Status::Ok && r.measured_total() <= CARD_BYTES)
        .map(|r| format!("{} `{}` ({} GiB)", r.model, r.policy, cell(r.measured_total())))
        .collect();
    if records.iter().any(|r| r.status == Status::Ok && returned_freed_memory(r)) {
        out += "\n† Measured with `--return-freed-memory` (freed memory given back to the OS at \
            once, so that resident memory stays near the live heap on this machine): every step \
            faults its pages in again, so its time is not comparable with the other rows'.\n";
    }
    let _ = write!(
        out,
        "\n## Fits 24 GiB at batch 1 (measured)\n\n{}\n",
        if fit.is_empty() { "None.".into() } else { fit.join(", ") }
    );
    out
}

/// A configuration's row of the table of predicted against measured.
fn measured_row(r: &Record) -> String {
    let (model, variant) = r.model.split_once('/').unwrap_or((&r.model, ""));
    let predicted = r.predicted_total_bytes.map_or("-".into(), cell);
    let seq = r.input.trim_start_matches("seq ").parse::<usize>().unwrap_or(0);
    let (measured, error, tokens, time) = if r.status == Status::Ok {
        let total = r.measured_total();
        let error = r
            .predicted_total_bytes
            .map_or("-".into(), |p| format!("{:+.1}%", (p as f64 / total as f64 - 1.0) * 100.0));
        let tokens = (r.batch * r.accumulate * seq) as f64;
        let mark = if returned_freed_memory(r) { " †" } else { "" };
        (
            cell(total),
            error,
            format!("{:.1}{mark}", tokens / (r.step_ms_median / 1000.0)),
            format!("{:.1} s{mark}", r.step_ms_median / 1000.0),
        )
    } else {
        (format!("not run: {}", r.error), "-".into(), "-".into(), "-".into())
    };
    let grads = match (r.status, r.grads_checked, r.grads_bit_identical) {
        (Status::Ok, true, true) => "= plain candle",
        (Status::Ok, true, false) => "DIFFER",
        (Status::Ok, false, _) => "not checked (memory)",
        _ => "-",
    };
    format!(
        "| {model} | {variant} | {} | {predicted} | {measured} | {error} | {} | {tokens} | {time} \
         | {grads} |",
        r.policy,
        fits(r)
    )
}

/// The figure of `--matrix gpt2-24gb`: `memory.png` and `.svg`.
pub fn plot(dir: &Path, m: &Matrix, _profile: Profile) -> Result<()> {
    plot::both(dir, "memory", (1100, 120 + 22 * m.records.len() as u32), &MemoryChart(m))
}

struct MemoryChart<'a>(&'a Matrix);

impl Chart for MemoryChart<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        memory_chart(root, self.0)
    }
}

/// The bars of the memory chart, bottom up (the largest model's last configuration first): each
/// configuration's label, state and total GiB, and whether it was measured (else predicted).
fn memory_bars(m: &Matrix) -> Vec<(String, f64, f64, bool)> {
    in_size_order(m)
        .into_iter()
        .rev()
        .filter_map(|r| {
            let state = r.state_bytes();
            match r.status {
                Status::Ok => Some((
                    format!("{} {}", r.model, r.policy),
                    units::gib(state),
                    units::gib(r.measured_total()),
                    true,
                )),
                _ => Some((
                    format!("{} {} ({})", r.model, r.policy, r.status),
                    units::gib(state),
                    units::gib(r.predicted_total_bytes?),
                    false,
                )),
            }
        })
        .collect()
}

/// Peak memory of every configuration as a bar split into the model state (weights, gradients,
/// optimizer state, by arithmetic) and the rest (activations and temporaries): measured where it
/// ran, predicted and pale where it did not; smallest model at the top, against a line at 24 GiB.
fn memory_chart<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, m: &Matrix) -> Result<()> {
    let bars = memory_bars(m);
    let max = bars.iter().map(|b| b.2).fold(26.0, f64::max) * 1.05;
    let n = bars.len().max(1) as i32;
    let mut chart = ChartBuilder::on(root)
        .caption(
            format!("GPT-2, batch 1, {}: peak memory by configuration", sizes(m)),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(360)
        .build_cartesian_2d(0.0..max, (0..n).into_segmented())
        .map_err(plot_err)?;
    let label = |y: &SegmentValue<i32>| match y {
        SegmentValue::CenterOf(i) => bars.get(*i as usize).map_or(String::new(), |b| b.0.clone()),
        _ => String::new(),
    };
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n as usize)
        .y_label_formatter(&label)
        .x_desc("GiB at the step's peak (measured; pale: predicted, not run)")
        .draw()
        .map_err(plot_err)?;
    let fill = |k: usize, measured: bool| {
        if measured {
            color(k).filled()
        } else {
            color(k).mix(0.3).filled()
        }
    };
    for (i, (_, state, total, measured)) in bars.iter().enumerate() {
        let (lo, hi) = (|| SegmentValue::Exact(i as i32), || SegmentValue::Exact(i as i32 + 1));
        let state = state.min(*total);
        chart
            .draw_series([Rectangle::new([(0.0, lo()), (state, hi())], fill(0, *measured))])
            .map_err(plot_err)?;
        chart
            .draw_series([Rectangle::new([(state, lo()), (*total, hi())], fill(1, *measured))])
            .map_err(plot_err)?;
    }
    // Legend entries for the two parts of a bar (empty rectangles: the bars are drawn above).
    for (k, part) in
        [(0, "weights, gradients, optimizer state"), (1, "activations and temporaries")]
    {
        let none = || SegmentValue::Exact(0);
        chart
            .draw_series([Rectangle::new([(0.0, none()), (0.0, none())], color(k).filled())])
            .map_err(plot_err)?
            .label(part)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 16, y + 5)], color(k).filled()));
    }
    chart
        .draw_series(LineSeries::new(
            [(24.0, SegmentValue::Exact(0)), (24.0, SegmentValue::Exact(n))],
            color(3).stroke_width(2),
        ))
        .map_err(plot_err)?
        .label("24 GiB")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], color(3).stroke_width(2)));
    plot::legend(&mut chart, SeriesLabelPosition::LowerRight)
}
