//! How results are reported. What a results folder holds: [`record`] (one configuration's
//! figures), [`results`] (the folder's `matrix.json`), [`units`]. How it is shown: `matrix.csv`
//! (one row per configuration and framework) and `matrix.md` (per model, each policy against `off`
//! from the same run; PyTorch side by side where it ran, [`baseline`]), written here with
//! [`save`], which writes every file of a folder; [`table`] (`TABLE.md`, the article's table,
//! [`projection`]), [`plot`], [`fits_24gb`]'s table and figure, and [`claims`] (the ledger of the
//! article's claims, rendered from the results).

pub mod baseline;
pub mod claims;
pub mod compiled;
pub mod fits_24gb;
pub mod kernels;
pub mod plot;
pub mod projection;
pub mod record;
pub mod results;
pub mod table;
pub mod units;

use anyhow::{Context, Result};
use record::{Baseline, Record, Status};
use results::{Matrix, Models};
use std::fmt::Write as _;
use std::path::Path;
use units::mib;

/// Writes every file of a results folder ([`write_file`]): `matrix.json`, the CSV, the
/// Markdown, TABLE.md and the plots.
pub fn save(m: &Matrix, dir: &Path) -> Result<()> {
    m.save_json(dir)?;
    write_file(&dir.join("matrix.csv"), csv(m))?;
    write_file(&dir.join("matrix.md"), markdown(m))?;
    if let Some(profile) = m.profile().filter(|p| p.asks_24gb()) {
        write_file(&dir.join("TABLE.md"), fits_24gb::table(m, profile))?;
        return fits_24gb::plot(dir, m, profile);
    }
    let fits = m.depth_fits();
    write_file(&dir.join("TABLE.md"), self::table::render(m, &fits))?;
    self::plot::all(dir, m, &fits)
}

/// Writes `contents` to `path` through a temporary beside it, renamed over it once whole: an
/// interrupted run or a full disk leaves the previous file (finished configurations are never
/// lost), not a partial one; the error names the file.
pub fn write_file(path: &Path, contents: impl AsRef<[u8]>) -> Result<()> {
    params::write_atomically(path, |tmp| Ok(std::fs::write(tmp, contents.as_ref())?))
        .with_context(|| format!("writing {}", path.display()))
}

/// One row per record and per PyTorch baseline, the columns of [`COLUMNS`].
pub fn csv(m: &Matrix) -> String {
    let mut out = COLUMNS.iter().map(|c| c.name).collect::<Vec<_>>().join(",") + "\n";
    for r in &m.records {
        out += &(COLUMNS.iter().map(|c| (c.ours)(r)).collect::<Vec<_>>().join(",") + "\n");
    }
    for b in &m.baselines {
        let ours = m.find(&b.model, &b.policy);
        out += &(COLUMNS.iter().map(|c| (c.theirs)(b, ours)).collect::<Vec<_>>().join(",") + "\n");
    }
    out
}

/// `matrix.md`: the provenance and how to read the tables, the planner's accuracy, one section
/// per model, then PyTorch side by side.
pub fn markdown(m: &Matrix) -> String {
    let mut out = header(m);
    planner_summary(&mut out, m);
    for model in m.models(Models::Profile).iter().chain(&m.models(Models::DepthSweep)) {
        let rows: Vec<&Record> = m.records.iter().filter(|r| r.model == *model).collect();
        model_table(&mut out, m, &rows);
        if rows[0].ranks > 1 {
            ranks_table(&mut out, &rows);
        }
    }
    out.push_str(&self::baseline::side_by_side(m));
    out.push_str(&self::compiled::at_its_memory_levels(m));
    out
}

fn header(m: &Matrix) -> String {
    let meta = &m.meta;
    format!(
        "# Checkpointing matrix: profile `{}`\n\n{}  \nMachine: {}  \ncandle {}, commit \
         {}\n\nMemory is heap bytes from the counting allocator above the model state (parameters \
         + optimizer state); ratios are against `off` of the same model in the same run. Times are \
         medians of the timed steps after a warm-up. *Activation peak* is what checkpointing acts \
         on (forward and backward, parameter gradients excluded); *step peak* is the whole step, \
         and *peak set in* says whether forward/backward or the optimizer update (parameter-sized \
         temporaries) reached it. *time / off, rounds*: the same ratio over this run and the \
         interleaved timing rounds (off, policy, off, policy, ... each in a fresh process): median \
         (min-max). *grads = plain candle*: one step of the policy through the executor (`off` \
         included) against the same step in plain candle (every stage in order, one `backward()`), \
         every gradient and BatchNorm statistic compared bit for bit. *predicted*: the planner's \
         step peak (from the model's stages profiled one at a time before the run) and its error \
         against the measured step peak, and its predicted time / off.\n",
        meta.profile,
        self::results::made_by(m.record_commands(), &meta.command),
        meta.machine,
        meta.candle_version,
        meta.git_commit
    )
}

fn planner_summary(out: &mut String, m: &Matrix) {
    let errors = m.planner_errors();
    if let Some((worst, r)) = errors.iter().max_by(|a, b| a.0.abs().total_cmp(&b.0.abs())) {
        let within = errors.iter().filter(|(e, _)| e.abs() <= 0.05).count();
        let _ = writeln!(
            out,
            "\n**Planner**: predicted step peak within 5% of the measured for {within} of {} \
             configurations; the largest error is {:+.1}% ({} {}).",
            errors.len(),
            worst * 100.0,
            r.model,
            r.policy
        );
    }
}

fn model_table(out: &mut String, m: &Matrix, rows: &[&Record]) {
    let first = rows[0];
    // A failed `off` leaves nothing to divide by: the ratios show "-" rather than a wrong figure.
    let off = m.find(&first.model, "off").filter(|r| r.status == Status::Ok);
    let _ = write!(
        out,
        "\n## {} (batch {}, {}, {}, {} threads): model state {}\n\n| policy | segments | step peak \
         | predicted (error) | peak set in | activation peak | RSS peak delta | step time (median) \
         | step peak / off | activation / off | time / off | predicted time / off | time / off, \
         rounds | grads = plain candle (bits) | status | commit \
         |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        first.model,
        first.batch,
        first.input,
        first.dtype,
        first.threads,
        mib(first.model_state_bytes)
    );
    for r in rows {
        if r.status == Status::Ok {
            record_row(out, r, off);
        } else {
            let _ = writeln!(
                out,
                "| {} | | | | | | | | | | | | | | {}: {} | {} |",
                r.policy,
                r.status,
                r.error.replace('|', "/"),
                commit(r)
            );
        }
    }
}

fn record_row(out: &mut String, r: &Record, off: Option<&Record>) {
    let ratio = |a: f64, b: f64| if b > 0.0 { format!("{:.2}x", a / b) } else { "-".into() };
    let (peak, act, time) = match off {
        Some(o) => (
            ratio(r.step_peak_bytes as f64, o.step_peak_bytes as f64),
            ratio(r.activation_peak_bytes as f64, o.activation_peak_bytes as f64),
            ratio(r.step_ms_median, o.step_ms_median),
        ),
        None => ("-".into(), "-".into(), "-".into()),
    };
    let grads = match (r.grads_checked, r.grads_bit_identical) {
        (false, _) if !r.check_skipped.is_empty() => format!("not checked: {}", r.check_skipped),
        (false, _) => "not checked".to_string(),
        (true, true) => "yes".to_string(),
        (true, false) => format!("no ({} differ, max {:e})", r.grads_differing, r.max_abs_diff),
    };
    let rounds = r.time_vs_off.as_ref().map_or("-".into(), |t| {
        format!("{:.2}x ({:.2}-{:.2}, {} rounds)", t.median, t.min, t.max, t.rounds.len())
    });
    let predicted = r.predicted_peak_bytes.map_or("-".into(), |p| {
        format!("{} ({:+.1}%)", mib(p), (p as f64 / r.step_peak_bytes.max(1) as f64 - 1.0) * 100.0)
    });
    let predicted_time = r.predicted_time_ratio.map_or("-".into(), |t| format!("{t:.2}x"));
    let policy =
        if r.plan.is_empty() { r.policy.clone() } else { format!("{} → `{}`", r.policy, r.plan) };
    let _ = writeln!(
        out,
        "| {policy} | {} | {} | {predicted} | {} | {} | {} | {:.0} ms ({:.0}-{:.0}) | {peak} | \
         {act} | {time} | {predicted_time} | {rounds} | {grads} | ok | {} |",
        r.segments,
        mib(r.step_peak_bytes),
        if r.step_peak_bytes > r.fwd_bwd_peak_bytes { "optimizer" } else { "fwd/bwd" },
        mib(r.activation_peak_bytes),
        mib(r.rss_peak_delta_bytes),
        r.step_ms_median,
        r.step_ms_min,
        r.step_ms_max,
        commit(r)
    );
}

/// The commit that measured `r`, or "-" for records from before rows named it (the folder's
/// header names its last run's).
fn commit(r: &Record) -> &str {
    if r.commit.is_empty() {
        "-"
    } else {
        &r.commit
    }
}

fn ranks_table(out: &mut String, rows: &[&Record]) {
    let first = rows[0];
    let _ =
        write!(
        out,
        "\n{} ranks (MPI), batch {} each{}: memory above is rank 0's.\n\n| policy | model state, \
         rank 0 | model state, largest rank | step peak, rank 0 | step peak, largest rank | \
         all-reduce per step | training thread waited (dividing included) \
         |\n|---|---|---|---|---|---|---|\n",
        first.ranks,
        first.batch,
        if first.shard_optimizer { ", optimizer state sharded over the ranks (ZeRO stage \
            1)" } else { "" }
    );
    let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1} ms"));
    let largest = |v: Option<u64>| v.map_or("-".into(), mib);
    for r in rows.iter().filter(|r| r.status == Status::Ok) {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} |",
            r.policy,
            mib(r.model_state_bytes),
            largest(r.model_state_bytes_max_rank),
            mib(r.step_peak_bytes),
            largest(r.step_peak_bytes_max_rank),
            ms(r.all_reduce_ms),
            ms(r.all_reduce_wait_ms)
        );
    }
}

/// One column of `matrix.csv`, declared once: its name, its cell for one of our records, and its
/// cell for a PyTorch row (given our record of the same configuration; empty where the script
/// measures no such figure: no gradient check, no activation timeline).
struct Column {
    name: &'static str,
    ours: fn(&Record) -> String,
    theirs: fn(&Baseline, Option<&Record>) -> String,
}

fn quoted(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

fn ms(v: &f64) -> String {
    format!("{v:.3}")
}

/// An optional figure's text, empty where there is none.
fn or_empty<T: ToString>(v: &Option<T>) -> String {
    v.as_ref().map_or(String::new(), ToString::to_string)
}

/// An optional time's text ([`ms`]), empty where there is none.
fn ms_or_empty(v: &Option<f64>) -> String {
    v.as_ref().map_or(String::new(), ms)
}

fn none(_: &Baseline, _: Option<&Record>) -> String {
    String::new()
}

/// A spread's median, min or max, empty where there is none.
fn spread(s: &Option<self::record::Spread>, pick: fn(&self::record::Spread) -> f64) -> String {
    s.as_ref().map_or(String::new(), |t| ms(&pick(t)))
}

/// The [`Column`] of a figure our records and PyTorch's rows both hold, named as their field:
/// each side's written by `text` (its `Display` where no `text` is named).
macro_rules! both {
    ($field:ident) => {
        both!($field, ToString::to_string)
    };
    ($field:ident, $text:expr) => {
        Column {
            name: stringify!($field),
            ours: |r| $text(&r.$field),
            theirs: |b, _| $text(&b.$field),
        }
    };
}

/// The [`Column`] of a figure only our records hold (empty in PyTorch's rows), named as its
/// field, written by `text` (its `Display` where no `text` is named).
macro_rules! ours {
    ($field:ident) => {
        ours!($field, ToString::to_string)
    };
    ($field:ident, $text:expr) => {
        Column { name: stringify!($field), ours: |r| $text(&r.$field), theirs: none }
    };
}

const COLUMNS: [Column; 46] = [
    Column {
        name: "framework",
        ours: |_| "candle".into(),
        theirs: |b, _| format!("pytorch {}", b.framework_version),
    },
    both!(model),
    both!(policy, quoted),
    both!(batch),
    Column { name: "accumulate", ours: |r| r.accumulate.to_string(), theirs: |_, _| "1".into() },
    Column {
        name: "optimizer",
        ours: |r| r.optimizer.clone(),
        theirs: |_, r| r.map_or(String::new(), |r| r.optimizer.clone()),
    },
    Column {
        name: "skipped_updates",
        ours: |r| r.skipped_updates.to_string(),
        theirs: |_, _| "0".into(),
    },
    Column {
        name: "input",
        ours: |r| r.input.clone(),
        theirs: |_, r| r.map_or(String::new(), |r| r.input.clone()),
    },
    Column { name: "dtype", ours: |r| r.dtype.clone(), theirs: |_, _| "f32".into() },
    Column { name: "device", ours: |r| r.device.clone(), theirs: |_, _| "cpu".into() },
    both!(threads),
    Column { name: "ranks", ours: |r| r.ranks.to_string(), theirs: |_, _| "1".into() },
    Column {
        name: "shard_optimizer",
        ours: |r| r.shard_optimizer.to_string(),
        theirs: |_, _| "false".into(),
    },
    both!(model_state_bytes),
    both!(step_peak_bytes),
    both!(fwd_bwd_peak_bytes),
    ours!(activation_peak_bytes),
    ours!(rss_peak_delta_bytes),
    ours!(minor_faults_per_step, or_empty),
    ours!(reserved_bytes, or_empty),
    ours!(model_state_bytes_max_rank, or_empty),
    ours!(step_peak_bytes_max_rank, or_empty),
    both!(step_ms_median, ms),
    both!(step_ms_min, ms),
    both!(step_ms_max, ms),
    ours!(all_reduce_ms, ms_or_empty),
    ours!(all_reduce_wait_ms, ms_or_empty),
    both!(timed_steps),
    both!(segments),
    both!(loss),
    ours!(grads_bit_identical),
    ours!(grads_checked),
    ours!(predicted_total_bytes, or_empty),
    ours!(predicted_peak_bytes, or_empty),
    Column {
        name: "predicted_time_ratio",
        ours: |r| r.predicted_time_ratio.map_or(String::new(), |t| format!("{t:.3}")),
        theirs: none,
    },
    ours!(plan, quoted),
    ours!(grads_differing),
    Column { name: "max_abs_diff", ours: |r| format!("{:e}", r.max_abs_diff), theirs: none },
    ours!(params_without_grad),
    ours!(check_skipped, quoted),
    both!(status),
    both!(commit),
    both!(error, quoted),
    Column {
        name: "time_vs_off_median",
        ours: |r| spread(&r.time_vs_off, |t| t.median),
        theirs: |b, _| spread(&b.time_vs_off, |t| t.median),
    },
    Column {
        name: "time_vs_off_min",
        ours: |r| spread(&r.time_vs_off, |t| t.min),
        theirs: |b, _| spread(&b.time_vs_off, |t| t.min),
    },
    Column {
        name: "time_vs_off_max",
        ours: |r| spread(&r.time_vs_off, |t| t.max),
        theirs: |b, _| spread(&b.time_vs_off, |t| t.max),
    },
];
