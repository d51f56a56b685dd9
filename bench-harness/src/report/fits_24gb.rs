//! The table (`TABLE.md`) and figure of the matrices that ask what fits a 24 GiB card:
//! `gpt2-24gb` (GPT-2 at every published size) and `llm-24gb` (the Llama family from 0.5B to 8B
//! parameters, fully fine-tuned or with LoRA). Each configuration trains at batch 1 with
//! micro-batches accumulated (one with the optimizer inside backward), in each way of holding its
//! state, under each policy: the predicted bytes (with the state's arithmetic) and time, the
//! measured peak where it ran, whether it fits 24 GiB and, where it does not, the smallest change
//! that makes it fit.
//!
//! The experiment's other layers: [`crate::run::fits_24gb`] (its defaults, the prediction, the
//! skip) and [`crate::measure::projection`] (the projection the predictions come from).

use super::plot::{self, color, plot_err, Chart};
use super::record::{Prediction, ProjectedPolicy, Record, Status};
use super::results::Matrix;
use super::units;
use crate::workloads::STATE_VARIANTS;
use crate::workloads::{self, Profile, CARD_BYTES, IN_BACKWARD, LLM_VARIANTS, LORA_R16};
use anyhow::Result;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::fmt::Write as _;
use std::path::Path;

/// A configuration's name in parts: `gpt2-xl/bf16-weights-adamw` or
/// `llama-3.1-8b/2048/lora-r16`: the model and the way its state is held.
fn parts(r: &Record) -> (&str, &str) {
    let model = r.model.split('/').next().unwrap_or(&r.model);
    let variant = r.model.rsplit('/').next().filter(|v| *v != model).unwrap_or("");
    (model, variant)
}

/// The sequence of a record, from its input (`seq 2048`).
fn seq(r: &Record) -> usize {
    r.input.trim_start_matches("seq ").parse().unwrap_or(0)
}

/// The variants of a profile in the order a change that makes a configuration fit prefers them.
fn variants(profile: Profile) -> Vec<&'static str> {
    match profile {
        Profile::Llm24gb => LLM_VARIANTS.iter().map(|v| v.0).collect(),
        _ => STATE_VARIANTS.iter().map(|v| v.0).collect(),
    }
}

/// The sequences and the micro-batches of the matrix's configurations, in words: "seq 1024, 2
/// micro-batches accumulated per optimizer step (1 with the optimizer inside backward)".
fn sizes(m: &Matrix) -> String {
    let mut inputs: Vec<&str> = Vec::new();
    for r in &m.records {
        if !inputs.contains(&r.input.as_str()) {
            inputs.push(&r.input);
        }
    }
    let input = if inputs.is_empty() { "?".into() } else { inputs.join(" and ") };
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

/// The records in the order of the profile's models (smallest first), then sequence, then
/// variant; within those, the matrix's order (policy), whatever order the runs came in.
pub fn in_size_order(m: &Matrix, profile: Profile) -> Vec<&Record> {
    let mut models: Vec<String> = Vec::new();
    for w in workloads::profile(profile) {
        let model = w.model.split('/').next().unwrap_or(&w.model).to_string();
        if !models.contains(&model) {
            models.push(model);
        }
    }
    let variants = variants(profile);
    let mut records: Vec<&Record> = m.records.iter().collect();
    records.sort_by_key(|r| {
        let (model, variant) = parts(r);
        let at = |list: &[&str], x: &str| list.iter().position(|m| *m == x);
        let model_at = models.iter().position(|m| m == model);
        (model_at, seq(r), at(&variants, variant))
    });
    records
}

/// The (model, variant) pairs of `records`, in their order.
fn rows<'a>(records: &[&'a Record]) -> Vec<(&'a str, &'a str)> {
    let mut rows = Vec::new();
    for r in records {
        if !rows.contains(&parts(r)) {
            rows.push(parts(r));
        }
    }
    rows
}

/// The sequences of `records`, shortest first.
fn seqs(records: &[&Record]) -> Vec<usize> {
    let mut seqs: Vec<usize> = records.iter().map(|r| seq(r)).collect();
    seqs.sort();
    seqs.dedup();
    seqs
}

/// The total bytes of a configuration at its step's peak: measured where it ran, else predicted.
fn total(r: &Record) -> Option<u64> {
    match r.status {
        Status::Ok => Some(r.measured_total()),
        _ => r.predicted_total_bytes,
    }
}

/// Whether a configuration fits 24 GiB: measured, or predicted where it did not run (`None`
/// where neither says: an error, or a budget no plan fits).
fn fits_card(r: &Record) -> Option<bool> {
    match r.status {
        Status::Ok => Some(r.measured_total() <= CARD_BYTES),
        Status::Oom if !r.error.contains("SIGKILL") => Some(false),
        _ => Some(r.predicted_total_bytes? <= CARD_BYTES),
    }
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

/// The projection's row of a configuration: its predicted time over `off`'s.
fn projected<'a>(m: &'a Matrix, r: &Record) -> Option<&'a ProjectedPolicy> {
    let projection = m.projections.iter().find(|p| p.model == r.model)?;
    projection.rows.iter().find(|row| row.label == r.policy)
}

/// Of `candidates`, the one that fits 24 GiB with the least predicted time (then the least
/// memory).
fn quickest_fit<'a>(
    m: &Matrix,
    candidates: impl Iterator<Item = &'a Record>,
) -> Option<&'a Record> {
    candidates.filter(|r| fits_card(r) == Some(true)).min_by(|a, b| {
        let time = |r: &Record| projected(m, r).map_or(f64::INFINITY, |p| p.time_ratio);
        time(a).total_cmp(&time(b)).then(total(a).cmp(&total(b)))
    })
}

/// A fitting configuration in a few words: its policy and, where they differ from `of`'s, its
/// sequence and variant.
fn describe_fit(m: &Matrix, fit: &Record, of: &Record) -> String {
    let mut changes = Vec::new();
    if seq(fit) != seq(of) {
        changes.push(fit.input.clone());
    }
    if parts(fit).1 != parts(of).1 {
        changes.push(parts(fit).1.to_string());
    }
    changes.push(format!("`{}`", fit.policy));
    let time = projected(m, fit).map_or(String::new(), |p| format!(", {:.2}x off", p.time_ratio));
    let bytes = total(fit).map_or(String::new(), |t| format!(" ({} GiB{time})", cell(t)));
    changes.join(", ") + &bytes
}

/// The smallest change that makes `r` fit 24 GiB, where it does not: another policy; else another
/// way of holding the state at the same sequence (a precision, the optimizer inside backward, in
/// the profile's order of preference; LoRA is another kind of fine-tuning, not such a change);
/// else a shorter sequence with the same state. `None` where `r` fits or nothing says.
fn smallest_change(m: &Matrix, profile: Profile, r: &Record) -> Option<String> {
    if fits_card(r)? {
        return None;
    }
    let (model, variant) = parts(r);
    let same = |x: &Record| parts(x).0 == model;
    let lora = |v: &str| v == LORA_R16;
    let policy = quickest_fit(m, m.records.iter().filter(|x| x.model == r.model));
    let state = || {
        let others =
            variants(profile).into_iter().filter(|v| *v != variant && lora(v) == lora(variant));
        others.into_iter().find_map(|v| {
            quickest_fit(
                m,
                m.records.iter().filter(|x| same(x) && seq(x) == seq(r) && parts(x).1 == v),
            )
        })
    };
    let shorter = || {
        let shorter =
            m.records.iter().filter(|x| same(x) && parts(x).1 == variant && seq(x) < seq(r));
        quickest_fit(m, shorter)
    };
    let fit = policy.or_else(state).or_else(shorter);
    let none = || format!("none of these (its state alone: {} GiB)", cell(r.state_bytes()));
    Some(fit.map_or_else(none, |fit| describe_fit(m, fit, r)))
}

/// Whether `r` was measured with freed memory given back at once: every step faulted its pages
/// in again, so its time is not the other rows' kind.
fn returned_freed_memory(r: &Record) -> bool {
    r.command.contains("--return-freed-memory")
}

fn state_row(r: &Record, p: &Prediction) -> String {
    let (model, variant) = parts(r);
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

/// The title and the variants in words, for each matrix.
fn title_and_variants(profile: Profile) -> (&'static str, String) {
    match profile {
        Profile::Llm24gb => (
            "Llama-family fine-tunes on 24 GiB: state, precision, optimizer, LoRA and \
             checkpointing",
            format!(
                "Models: Qwen2.5-0.5B, Llama-3.2-1B, Llama-3.2-3B, Qwen2.5-7B, Llama-3.1-8B at \
                 their published shapes (`train-llama --preset`). Variants, each with AdamW: \
                 `f32-adamw` (everything f32), `bf16-weights-adamw` (bf16 activations, \
                 parameters and gradients, f32 AdamW moments: no f32 master copy), \
                 `{IN_BACKWARD}` (`f32-adamw` with the optimizer inside backward: each gradient \
                 applied and freed as soon as it is final, one micro-batch per step), `{LORA_R16}` \
                 (LoRA of rank 16, alpha 32, on all seven projections, over a frozen bf16 base: \
                 bf16 activations, adapters, their gradients; f32 AdamW moments of the adapters \
                 only)."
            ),
        ),
        _ => (
            "GPT-2 on 24 GiB: state, precision, optimizer and checkpointing, measured",
            format!(
                "Variants: `f32-adamw` (everything f32), `bf16-adamw` (bf16 activations, f32 \
                 parameters, gradients and AdamW moments), `bf16-weights-adamw` (bf16 \
                 activations, parameters and gradients, f32 AdamW moments: no f32 master copy), \
                 `bf16-adafactor` (bf16 activations, f32 parameters and gradients, Adafactor's \
                 factored second moment), `{IN_BACKWARD}` (`f32-adamw` with the optimizer inside \
                 backward: each gradient applied and freed as soon as it is final, one \
                 micro-batch per step)."
            ),
        ),
    }
}

/// `TABLE.md`.
pub fn table(m: &Matrix, profile: Profile) -> String {
    let meta = &m.meta;
    let (title, variants) = title_and_variants(profile);
    let mut out = format!(
        "# {title}\n\n{}  \nMachine: {}  \ncandle {}, commit {}, profile `{}`\n\nEvery \
         configuration trains at batch 1, {}. {variants}\n\n",
        super::results::made_by(m.records.iter().map(|r| r.command.as_str()), &meta.command),
        meta.machine,
        meta.candle_version,
        meta.git_commit,
        meta.profile,
        sizes(m)
    );
    let records = in_size_order(m, profile);
    fits_summary(&mut out, m, profile, &records);
    out += "\n## The model state, by arithmetic\n\nParameters and gradients 4 bytes each (2 \
        under `bf16-weights`); AdamW 8 bytes per trained parameter; Adafactor 4 bytes per row and \
        per column of each weight matrix (per element of a vector). Under LoRA the base is held \
        without gradients or optimizer state. Computed from the parameter shapes, not measured. \
        The last two columns are one rank's state when the optimizer state is sharded over 2 or 4 \
        data-parallel ranks (`--ranks N --shard-optimizer`, ZeRO stage 1: every rank still holds \
        all parameters and gradients). With the optimizer inside backward no gradient is held \
        through the step: the ones in flight are part of the step's peak, with the \
        activations.\n\n| model | variant | parameters | params GiB | grads GiB | optimizer \
        GiB | state GiB | per rank, sharded over 2 | over 4 \
        |\n|---|---|---|---|---|---|---|---|---|\n";
    let mut seen = Vec::new();
    for r in &records {
        let Some(p) = r.predicted else { continue };
        if !seen.contains(&parts(r)) {
            seen.push(parts(r));
            let _ = writeln!(out, "{}", state_row(r, &p));
        }
    }
    out += "\n## Predicted against measured\n\nPredicted total: the planner's, from the model \
        built at its size and its stages profiled one at a time at batch 1 and the full sequence \
        (one block measured, its figures reused for the others, which are alike; a Llama-family \
        model is built two blocks deep and its profile deepened to its depth), the state by \
        arithmetic; predicted time: the plan's step over `off`'s, from the profiled stage times \
        on this machine. Measured total: the heap before the step (parameters, optimizer state) \
        plus the step's peak above it (gradients, activations), the highest over the timed \
        steps. Configurations predicted above the memory cap are not run; with `--dry-run`, none \
        is, and every row is a prediction. Smallest change: for a configuration that does not \
        fit, the quickest policy that does; else another way of holding the state at the same \
        sequence (in the order the variants are listed above; LoRA is another kind of \
        fine-tuning, not such a change); else a shorter sequence. The meter counts live bytes; \
        the allocator keeps freed pages for reuse (a step faults in no new memory), so a \
        process's resident memory runs above its live heap (by 3-4 GiB for GPT-2 XL): near a \
        machine's limit the kernel may kill a run whose live heap fits, which the table \
        says.\n\n| model | seq | variant | policy | predicted GiB | time / off, predicted | fits \
        24 GiB | smallest change that fits | measured GiB | error | tokens/s | step time | \
        gradients |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for r in &records {
        let _ = writeln!(out, "{}", measured_row(m, profile, r));
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

/// `TABLE.md`'s answer first: for each model and variant, at each sequence, the quickest policy
/// that fits 24 GiB (predicted, or measured where it ran), or the smallest change that makes it
/// fit.
fn fits_summary(out: &mut String, m: &Matrix, profile: Profile, records: &[&Record]) {
    let seqs = seqs(records);
    let _ = write!(
        out,
        "## What fits 24 GiB\n\nFor each model and way of holding its state: the quickest policy \
         that fits 24 GiB (its total and predicted time over `off`), or where none does, the \
         smallest change that makes it fit.\n\n| model | variant |{}\n|---|---|{}\n",
        seqs.iter().map(|s| format!(" seq {s} |")).collect::<String>(),
        "---|".repeat(seqs.len())
    );
    for (model, variant) in rows(records) {
        let cells: String = seqs
            .iter()
            .map(|&s| {
                let at = |x: &&&Record| parts(x) == (model, variant) && seq(x) == s;
                let configs: Vec<&Record> = records.iter().filter(at).copied().collect();
                let text = match (quickest_fit(m, configs.iter().copied()), configs.first()) {
                    (Some(fit), _) => describe_fit(m, fit, fit),
                    (None, Some(first)) => {
                        let change = smallest_change(m, profile, first);
                        format!("no: {}", change.unwrap_or_else(|| "not predicted".into()))
                    }
                    (None, None) => "-".into(),
                };
                format!(" {text} |")
            })
            .collect();
        let _ = writeln!(out, "| {model} | {variant} |{cells}");
    }
}

/// A configuration's row of the table of predicted against measured.
fn measured_row(m: &Matrix, profile: Profile, r: &Record) -> String {
    let (model, variant) = parts(r);
    let predicted = r.predicted_total_bytes.map_or("-".into(), cell);
    let time = projected(m, r).map_or("-".into(), |p| format!("{:.2}", p.time_ratio));
    let change = smallest_change(m, profile, r).unwrap_or_else(|| "-".into());
    let (measured, error, tokens, step) = if r.status == Status::Ok {
        let total = r.measured_total();
        let error = r
            .predicted_total_bytes
            .map_or("-".into(), |p| format!("{:+.1}%", (p as f64 / total as f64 - 1.0) * 100.0));
        let tokens = (r.batch * r.accumulate * seq(r)) as f64;
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
        "| {model} | {} | {variant} | {} | {predicted} | {time} | {} | {change} | {measured} | \
         {error} | {tokens} | {step} | {grads} |",
        seq(r),
        r.policy,
        fits(r)
    )
}

/// The figure: `memory.png` and `.svg`. `gpt2-24gb`: a bar per configuration; `llm-24gb` (four
/// times as many): a row per model and variant, a mark per policy, a panel per sequence.
pub fn plot(dir: &Path, m: &Matrix, profile: Profile) -> Result<()> {
    match profile {
        Profile::Llm24gb => {
            let rows = rows(&in_size_order(m, profile)).len() as u32;
            let size = (1300, 140 + 26 * rows);
            plot::both(dir, "memory", size, &PolicyChart(m, profile))
        }
        _ => plot::both(
            dir,
            "memory",
            (1100, 120 + 22 * m.records.len() as u32),
            &MemoryChart(m, profile),
        ),
    }
}

struct MemoryChart<'a>(&'a Matrix, Profile);

impl Chart for MemoryChart<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        memory_chart(root, self.0, self.1)
    }
}

/// The bars of the memory chart, bottom up (the largest model's last configuration first): each
/// configuration's label, state and total GiB, and whether it was measured (else predicted).
fn memory_bars(m: &Matrix, profile: Profile) -> Vec<(String, f64, f64, bool)> {
    in_size_order(m, profile)
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
fn memory_chart<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    m: &Matrix,
    profile: Profile,
) -> Result<()> {
    let bars = memory_bars(m, profile);
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

struct PolicyChart<'a>(&'a Matrix, Profile);

impl Chart for PolicyChart<'_> {
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()> {
        policy_chart(root, self.0, self.1)
    }
}

/// A panel per sequence: a row per model and variant (smallest model at the top), a mark per
/// policy at its total GiB (log scale; filled where measured, hollow where predicted), against a
/// line at 24 GiB.
fn policy_chart<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    m: &Matrix,
    profile: Profile,
) -> Result<()> {
    let records = in_size_order(m, profile);
    let (seqs, rows) = (seqs(&records), rows(&records));
    let mut policies: Vec<&str> = Vec::new();
    for r in &records {
        if !policies.contains(&r.policy.as_str()) {
            policies.push(&r.policy);
        }
    }
    let gib: Vec<f64> = records.iter().filter_map(|r| total(r)).map(units::gib).collect();
    let (lo, hi) = gib.iter().fold((16.0f64, 32.0f64), |(lo, hi), &g| (lo.min(g), hi.max(g)));
    let root = root
        .titled("The Llama family at batch 1: peak memory by policy", ("sans-serif", 20))
        .map_err(plot_err)?;
    let panels = root.split_evenly((1, seqs.len().max(1)));
    let n = rows.len().max(1) as i32;
    for (k, (panel, &s)) in panels.iter().zip(&seqs).enumerate() {
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("seq {s}"), ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(if k == 0 { 250 } else { 10 })
            .build_cartesian_2d((lo * 0.8..hi * 1.25).log_scale(), (0..n).into_segmented())
            .map_err(plot_err)?;
        let label = |y: &SegmentValue<i32>| match y {
            // Top down: the first row at the top.
            SegmentValue::CenterOf(i) if k == 0 => rows
                .get((n - 1 - *i) as usize)
                .map_or(String::new(), |(model, variant)| format!("{model} {variant}")),
            _ => String::new(),
        };
        chart
            .configure_mesh()
            .disable_y_mesh()
            .light_line_style(TRANSPARENT)
            .y_labels(n as usize)
            .y_label_formatter(&label)
            .x_labels(6)
            .x_label_formatter(&|gib| format!("{gib:.0}"))
            .x_desc("GiB at the step's peak (log; hollow: predicted)")
            .draw()
            .map_err(plot_err)?;
        for (j, policy) in policies.iter().enumerate() {
            let marks: Vec<(f64, i32, bool)> = records
                .iter()
                .filter(|r| seq(r) == s && r.policy == *policy)
                .filter_map(|r| {
                    let row = rows.iter().position(|p| *p == parts(r))? as i32;
                    Some((units::gib(total(r)?), n - 1 - row, r.status == Status::Ok))
                })
                .collect();
            let style = color(j);
            let series = chart
                .draw_series(marks.iter().map(|&(x, row, measured)| {
                    let at = (x, SegmentValue::CenterOf(row));
                    let shape = if measured { style.filled() } else { style.stroke_width(2) };
                    Circle::new(at, 5, shape)
                }))
                .map_err(plot_err)?;
            if k + 1 == seqs.len() {
                series
                    .label(policy.to_string())
                    .legend(move |(x, y)| Circle::new((x + 8, y), 5, style.filled()));
            }
        }
        chart
            .draw_series(LineSeries::new(
                [(24.0, SegmentValue::Exact(0)), (24.0, SegmentValue::Exact(n))],
                BLACK.stroke_width(2),
            ))
            .map_err(plot_err)?
            .label("24 GiB")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.stroke_width(2)));
        // In the last panel, bottom left: the largest models' marks lie right of it.
        if k + 1 == seqs.len() {
            plot::legend(&mut chart, SeriesLabelPosition::LowerLeft)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::record::Projection;

    const GIB: u64 = 1 << 30;

    /// A predicted, not run, configuration of `llm-24gb`'s 8B model at `seq` in `variant`.
    fn predicted(seq: usize, variant: &str, policy: &str, gib: u64) -> Record {
        Record {
            model: format!("llama-3.1-8b/{seq}/{variant}"),
            input: format!("seq {seq}"),
            policy: policy.into(),
            status: Status::Skipped,
            predicted_total_bytes: Some(gib * GIB),
            ..Record::default()
        }
    }

    /// Its projection: each policy's predicted time over `off`'s.
    fn projection(model: &str, times: &[(&str, f64)]) -> Projection {
        let rows = times
            .iter()
            .map(|&(label, time_ratio)| ProjectedPolicy {
                label: label.into(),
                plan: String::new(),
                peak_bytes: 0,
                total_bytes: 0,
                time_ratio,
            })
            .collect();
        Projection {
            model: model.into(),
            batch: 1,
            input: String::new(),
            optimizer: String::new(),
            dtype: String::new(),
            state_bytes: 0,
            rows,
            command: String::new(),
        }
    }

    /// The smallest change that fits: the quickest fitting policy first, then another way of
    /// holding the state (in the profile's order, never LoRA for full fine-tuning), then a shorter
    /// sequence; "none of these", with the state's size, where nothing fits.
    #[test]
    fn the_smallest_change_that_fits() {
        let times = [("off", 1.0), ("sqrt", 1.4), ("every-two-blocks", 1.3)];
        let records = vec![
            // At 4096, f32 fits under every-two-blocks only, sqrt also fitting but slower.
            predicted(4096, "f32-adamw", "off", 40),
            predicted(4096, "f32-adamw", "sqrt", 23),
            predicted(4096, "f32-adamw", "every-two-blocks", 22),
            // bf16-weights fits under nothing at 4096, but at 2048; in-backward fits at 4096.
            predicted(4096, "bf16-weights-adamw", "off", 30),
            predicted(4096, "bf16-weights-adamw", "sqrt", 25),
            predicted(2048, "bf16-weights-adamw", "sqrt", 20),
            predicted(4096, IN_BACKWARD, "sqrt", 21),
            // LoRA never fits: no other variant is a change for it.
            predicted(4096, LORA_R16, "off", 30),
        ];
        let projections = records.iter().map(|r| projection(&r.model, &times)).fold(
            Vec::<Projection>::new(),
            |mut all, p| {
                if !all.iter().any(|q| q.model == p.model) {
                    all.push(p);
                }
                all
            },
        );
        let m = Matrix { records, projections, ..Matrix::default() };
        let change = |i: usize| smallest_change(&m, Profile::Llm24gb, &m.records[i]);
        assert_eq!(change(0).as_deref(), Some("`every-two-blocks` (22.00 GiB, 1.30x off)"));
        assert_eq!(change(1), None, "sqrt fits");
        assert_eq!(
            change(3).as_deref(),
            Some("f32-adamw, `every-two-blocks` (22.00 GiB, 1.30x off)"),
            "f32-adamw comes first in the order of preference"
        );
        // With its state's size: what no policy can remove.
        let lora_state = Prediction { params: 15 * GIB, ..Prediction::default() };
        let lora = Record { predicted: Some(lora_state), ..m.records[7].clone() };
        assert_eq!(
            smallest_change(&m, Profile::Llm24gb, &lora).as_deref(),
            Some("none of these (its state alone: 15.00 GiB)")
        );
        // Without f32-adamw's rows, bf16-weights at 4096 takes the optimizer inside backward.
        let without_f32 = Matrix {
            records: m
                .records
                .iter()
                .filter(|r| !r.model.ends_with("/f32-adamw"))
                .cloned()
                .collect(),
            ..m.clone()
        };
        let change = smallest_change(&without_f32, Profile::Llm24gb, &without_f32.records[0]);
        assert_eq!(change.as_deref(), Some("f32-adamw-in-backward, `sqrt` (21.00 GiB, 1.40x off)"));
        // With no other variant fitting, the shorter sequence.
        let only_bf16 = Matrix {
            records: m.records.iter().filter(|r| r.model.contains("bf16")).cloned().collect(),
            ..m.clone()
        };
        let change = smallest_change(&only_bf16, Profile::Llm24gb, &only_bf16.records[0]);
        assert_eq!(change.as_deref(), Some("seq 2048, `sqrt` (20.00 GiB, 1.40x off)"));
    }
}
