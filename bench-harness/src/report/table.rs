//! `TABLE.md`: the article's A100 table next to the same columns measured by this matrix, and the
//! depth sweep's fitted exponents.
//!
//! The matrices' other layers: [`crate::run::matrix`] (the run) and [`crate::measure::one`] (each
//! configuration measured).

use super::baseline::side_by_side;
use super::record::{Record, Status};
use super::results::{depth_of, Matrix, Models};
use super::units::{mib, size};
use std::fmt::Write as _;

/// One row of the article's table (section 4; ResNet-152 from section 1, GPT-2 from section 7).
struct ArticleRow {
    label: &'static str,
    /// Our model names that stand for it, best first.
    models: &'static [&'static str],
    batch: &'static str,
    off_gb: Option<f64>,
    ckpt_gb: f64,
    time: Option<&'static str>,
}

const ARTICLE: [ArticleRow; 5] = [
    ArticleRow {
        label: "ResNet-50",
        models: &["resnet50", "resnet-tiny"],
        batch: "256",
        off_gb: Some(9.8),
        ckpt_gb: 5.2,
        time: Some("+18%"),
    },
    ArticleRow {
        label: "BERT-Large",
        models: &["bert-large", "bert-tiny"],
        batch: "32",
        off_gb: Some(22.0),
        ckpt_gb: 14.0,
        time: Some("+27%"),
    },
    ArticleRow {
        label: "UNet3D",
        models: &["unet3d-cicek", "unet3d-small", "unet3d-tiny"],
        batch: "8",
        off_gb: Some(48.0),
        ckpt_gb: 31.0,
        time: Some("+35%"),
    },
    ArticleRow {
        label: "ResNet-152",
        models: &["resnet152"],
        batch: "?",
        off_gb: Some(12.0),
        ckpt_gb: 7.0,
        time: Some("+25%"),
    },
    ArticleRow {
        label: "GPT-2 1.5B (+ accumulation)",
        models: &["gpt2-xl", "gpt2-large", "gpt2-medium", "gpt2-small", "gpt2-tiny"],
        batch: "1",
        off_gb: None,
        ckpt_gb: 21.0,
        time: None,
    },
];

/// `r`'s step time over `off`'s: the median over the measuring run and the interleaved timing
/// rounds where they ran, else the measuring run's pair.
pub fn time_vs_off(r: &Record, off: &Record) -> f64 {
    r.time_vs_off.as_ref().map_or(r.step_ms_median / off.step_ms_median, |s| s.median)
}

/// The policy that fills the "with checkpointing" column.
pub const TABLE_POLICY: &str = "sqrt";

/// `TABLE.md`: the article's rows against ours, the depth sweep (`fits`: each policy's fitted
/// exponent), the article's table projected at its sizes, and PyTorch beside ours.
pub fn render(m: &Matrix, fits: &[(String, f64)]) -> String {
    let meta = &m.meta;
    let mut out = format!(
        "# The article's table, measured\n\n{}  \nMachine: {}  \ncandle {}, commit {}, profile \
         `{}`\n\n*Memory* is what a step holds at its peak: model state (parameters, optimizer \
         state) plus the step's peak above it, from the counting allocator (on a GPU: the memory \
         pool). *With checkpointing* is policy `{TABLE_POLICY}`; every policy is in `matrix.csv`. \
         *Time increase* is the step time over `off`'s, the median over the measuring run and the \
         interleaved timing rounds (`matrix.md` has their range). The article's figures (A100, \
         PyTorch) are quoted for comparison, not measured here.\n\n| model | batch | input | \
         memory off | memory {TABLE_POLICY} | {TABLE_POLICY} / off | activations {TABLE_POLICY} / \
         off | {TABLE_POLICY} step peak set by | time increase | article: batch | article: off | \
         article: checkpointing | article: ratio | article: time \
         |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        super::results::made_by(m.record_commands(), &meta.command),
        meta.machine,
        meta.candle_version,
        meta.git_commit,
        meta.profile
    );
    for row in &ARTICLE {
        out.push_str(&article_row(m, row));
    }
    out.push_str(
        "\nWhere the step peak is set by the optimizer update (parameter-sized temporaries), \
         checkpointing cannot lower it further: the activations column shows what it did to the \
         memory it acts on. Every policy is in `matrix.md`.\n",
    );
    if !fits.is_empty() {
        out.push_str(&depth_sweep(m, fits));
    }
    out.push_str(&super::projection::render(m, |model| {
        ARTICLE
            .iter()
            .find(|r| r.models.contains(&model))
            .and_then(|r| Some((r.off_gb?, r.ckpt_gb, r.time?)))
    }));
    out.push_str(&side_by_side(m));
    out.push_str(&super::compiled::at_its_memory_levels(m));
    out
}

/// The line of `TABLE.md` for one row of the article's table: ours measured (or predicted where
/// the planner said it would not fit) beside the article's figures.
fn article_row(m: &Matrix, row: &ArticleRow) -> String {
    let mut out = String::new();
    let article = format!(
        "{} | {} | {} GB | {} | {}",
        row.batch,
        row.off_gb.map_or("-".into(), |g| format!("{g} GB")),
        row.ckpt_gb,
        row.off_gb.map_or("-".into(), |g| format!("{:.2}", row.ckpt_gb / g)),
        row.time.unwrap_or("-")
    );
    let found = row
        .models
        .iter()
        .find_map(|name| Some((m.find(name, "off")?, m.find(name, TABLE_POLICY)?)));
    match found {
        Some((off, ck)) if off.status == Status::Ok && ck.status == Status::Ok => {
            let _ = writeln!(
                out,
                "| {} ({}) | {} | {} | {} | {} | {:.2} | {:.2} | {} | {:+.0}% | {article} |",
                row.label,
                off.model,
                off.batch,
                off.input,
                size(off.measured_total()),
                size(ck.measured_total()),
                ck.measured_total() as f64 / off.measured_total() as f64,
                ck.activation_peak_bytes as f64 / off.activation_peak_bytes.max(1) as f64,
                if ck.step_peak_bytes > ck.fwd_bwd_peak_bytes {
                    "optimizer update"
                } else {
                    "activations"
                },
                (time_vs_off(ck, off) - 1.0) * 100.0
            );
        }
        Some((off, ck)) => {
            // Not run where the planner predicted it would not fit: its prediction, marked.
            let total = |r: &Record| match (r.status, r.predicted_total_bytes) {
                (Status::Ok, _) => Some((r.measured_total(), "")),
                (Status::Skipped, Some(p)) => Some((p, " (predicted, not run)")),
                _ => None,
            };
            let cell = |r: &Record| {
                total(r)
                    .map_or(format!("{}: {}", r.status, r.error.replace('|', "/")), |(b, mark)| {
                        format!("{}{mark}", size(b))
                    })
            };
            let ratio = total(off)
                .zip(total(ck))
                .map_or(String::new(), |((o, _), (c, _))| format!("{:.2}", c as f64 / o as f64));
            let _ = writeln!(
                out,
                "| {} ({}) | {} | {} | {} | {} | {ratio} | | | | {article} |",
                row.label,
                off.model,
                off.batch,
                off.input,
                cell(off),
                cell(ck)
            );
        }
        None => {
            let _ =
                writeln!(out, "| {} | | | not in this matrix | | | | | | {article} |", row.label);
        }
    }
    out
}

/// The depth sweep's section (claim C2): the fitted exponents and each depth's activation peaks.
fn depth_sweep(m: &Matrix, fits: &[(String, f64)]) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "\n## Depth sweep (claim C2: O(sqrt L) memory)\n\nGPT-2 blocks of fixed width, activation \
         peak against the number of blocks L, least-squares exponent k of peak ~ L^k:\n\n| policy \
         | depths | exponent k |\n|---|---|---|\n"
    );
    let depths: Vec<String> =
        m.models(Models::DepthSweep).iter().map(|d| depth_of(d).to_string()).collect();
    for (policy, k) in fits {
        let _ = writeln!(out, "| {policy} | {} | {k:.2} |", depths.join(", "));
    }
    out.push_str(
        "\n| L | activation peak off | activation peak sqrt | sqrt / off |\n|---|---|---|---|\n",
    );
    for model in m.models(Models::DepthSweep) {
        let peak = |p: &str| {
            m.find(&model, p).filter(|r| r.status == Status::Ok).map(|r| r.activation_peak_bytes)
        };
        let cell = |b: Option<u64>| b.map_or("-".into(), mib);
        let ratio = peak("off")
            .zip(peak("sqrt"))
            .map_or("-".into(), |(o, s)| format!("{:.2}", s as f64 / o.max(1) as f64));
        let _ = writeln!(
            out,
            "| {} | {} | {} | {ratio} |",
            depth_of(&model),
            cell(peak("off")),
            cell(peak("sqrt"))
        );
    }
    out
}
