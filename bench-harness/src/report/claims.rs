//! `claims`: the documents that quote results, rendered from templates whose every figure is a
//! query of a results folder in double braces, answered from that folder's `matrix.json`:
//!
//! - `results/CLAIMS.md`, the ledger of the article's claims, from `results/CLAIMS.template.md`;
//! - the results table of `README.md` (between its [`README_BEGIN`] and [`README_END`] lines),
//!   from `results/README-results.template.md`.
//!
//! A query is `{{FOLDER MODEL POLICY MEASURE}}` for one record's figure, e.g.
//! `{{cpu-cpu resnet152 sqrt activation/off}}` (the measures are [`MEASURES`]);
//! `{{FOLDER depth POLICY exponent}}` for the depth sweep's fitted exponent;
//! `{{FOLDER planner MEASURE}}` for the planner's accuracy over the folder ([`PLANNER`]); or
//! `{{FOLDER compiled MODEL BUDGET MEASURE}}` for a compiled PyTorch run ([`COMPILED`]).
//!
//! No figure of these documents is typed by hand, so none can go stale silently: `--check` fails
//! where a document is not what its template and the results give (a rerun changed a figure, or a
//! hand edited the document).
//!
//! It runs nothing and measures nothing (no `run` or `measure` module): it reads the folders the
//! matrices wrote, through [`super::results::Matrix`].

use super::record::{Record, Status};
use super::results::Matrix;
use super::table::time_vs_off;
use super::units::size;
use anyhow::{bail, Context, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The record measures a query may ask for, with what each gives.
pub const MEASURES: [(&str, &str); 23] = [
    ("activation/off", "activation peak over `off`'s, e.g. 0.41"),
    ("peak/off", "step peak over `off`'s"),
    ("total/off", "state plus step peak over `off`'s"),
    ("time/off", "step time over `off`'s, median of the rounds, as a change: +25%"),
    ("time/off-range", "the same, lowest to highest round: -14% to +37%"),
    ("rounds", "how many rounds time/off is the median of"),
    ("total", "state plus step peak: 459.1 MiB, 18.11 GiB"),
    ("total-gb", "the same in GB (10^9 bytes): 19.4 GB"),
    ("saving", "`off`'s total less this one"),
    (
        "state",
        "weights, gradients and optimizer state: the prediction's arithmetic where the record has \
         one, else the measured state",
    ),
    ("state-max-rank", "the largest rank's state (data parallelism)"),
    ("predicted-total", "the predicted total"),
    (
        "predicted-time/off",
        "the predicted step time over `off`'s (its projection's), as a change: +43%",
    ),
    ("total-error", "the predicted total against the measured one: +0.4%"),
    ("step-peak", "the step's peak above the state"),
    ("step-ms", "median step time, ms"),
    ("all-reduce-ms", "all-reduce time per step, ms"),
    ("all-reduce-wait-ms", "time waited for the all-reduce per step, ms"),
    ("torch-step-peak", "PyTorch's step peak above its state"),
    ("torch-step-ms", "PyTorch's median step time, ms"),
    ("peak/torch", "our step peak over PyTorch's"),
    ("time/torch", "our step time over PyTorch's, median of the interleaved pairs"),
    ("time/torch-rounds", "how many pairs time/torch is the median of"),
];

/// The folder measures of `{{FOLDER planner MEASURE}}`.
pub const PLANNER: [(&str, &str); 4] = [
    ("configs", "how many measured records carry a prediction"),
    ("within-5%", "how many of them are predicted within 5% of the measured step peak"),
    ("largest-error", "the largest error of a predicted step peak, signed: -0.3%"),
    ("worst", "the configuration with the largest error: depth-1024 sqrt"),
];

/// The measures of `{{FOLDER compiled MODEL BUDGET MEASURE}}`: the model's step compiled by
/// torch.compile at that activation memory budget (`--baseline pytorch-compile`).
pub const COMPILED: [(&str, &str); 5] = [
    ("step-peak", "the compiled step's peak above its state"),
    ("step-ms", "the compiled step's median time, ms"),
    ("compile-s", "the time compiling took, s"),
    ("ours", "our fastest configuration whose step peak is at most the compiled step's: `sqrt`"),
    (
        "ours/compiled",
        "that configuration's step time over the compiled step's, median of the interleaved \
         rounds",
    ),
];

/// The README's results table lies between these lines.
pub const README_BEGIN: &str = "<!-- results table: rendered by `bench-harness claims` from \
    results/README-results.template.md -->";
pub const README_END: &str = "<!-- end of results table -->";

/// One rendered document: its template, and where the rendering goes (a whole file, or the part
/// of one between two lines).
struct Document {
    template: PathBuf,
    target: PathBuf,
    between: Option<(&'static str, &'static str)>,
}

/// The documents of the results folder `dir` (the README is in the folder above it).
fn documents(dir: &Path) -> [Document; 2] {
    [
        Document {
            template: dir.join("CLAIMS.template.md"),
            target: dir.join("CLAIMS.md"),
            between: None,
        },
        Document {
            template: dir.join("README-results.template.md"),
            target: dir.parent().unwrap_or(Path::new(".")).join("README.md"),
            between: Some((README_BEGIN, README_END)),
        },
    ]
}

/// What `claims` does with a document that is not what its template and the results give.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Writes the rendering over it.
    Write,
    /// Changes nothing and fails (`--check`).
    Check,
}

/// `claims`: renders every document from its template and the results under `dir`; where one
/// differs from that rendering, writes it or, [`Action::Check`], fails.
pub fn run(dir: &Path, action: Action) -> Result<()> {
    let docs = documents(dir);
    // The ledger is the point: without its template there is nothing to render or check (the
    // README's table is optional, for a results folder of another repository).
    if !docs[0].template.is_file() {
        bail!(
            "{} does not exist: `claims` renders {} from it (is --dir {} the results folder?)",
            docs[0].template.display(),
            file_name(&docs[0].target),
            dir.display()
        );
    }
    let mut folders = HashMap::new();
    for doc in docs {
        if !doc.template.exists() {
            continue;
        }
        let template = read(&doc.template)?;
        let rendered = render(&template, dir, &mut folders)
            .with_context(|| format!("rendering {}", doc.template.display()))?;
        let on_disk = if doc.target.exists() { read(&doc.target)? } else { String::new() };
        let wanted = match doc.between {
            None => format!(
                "<!-- Rendered by `cargo run --release -p bench-harness -- claims` from {}: edit \
                 that. -->\n{rendered}",
                file_name(&doc.template)
            ),
            Some((begin, end)) => splice(&on_disk, begin, end, &rendered)
                .with_context(|| format!("{}", doc.target.display()))?,
        };
        if on_disk == wanted {
            trainkit::say!(
                "{} is what {} and the results give",
                doc.target.display(),
                file_name(&doc.template)
            );
        } else if action == Action::Check {
            let line = on_disk
                .lines()
                .zip(wanted.lines())
                .position(|(a, b)| a != b)
                .unwrap_or(on_disk.lines().count().min(wanted.lines().count()))
                + 1;
            bail!(
                "{} is not what {} and the results give (first difference at line {line}): run \
                 `cargo run --release -p bench-harness -- claims` and commit it",
                doc.target.display(),
                file_name(&doc.template)
            );
        } else {
            super::write_file(&doc.target, wanted)?;
            trainkit::say!("wrote {}", doc.target.display());
        }
    }
    Ok(())
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

fn file_name(path: &Path) -> String {
    path.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned())
}

/// `text` with what lies between its lines `begin` and `end` replaced by `part`.
fn splice(text: &str, begin: &str, end: &str, part: &str) -> Result<String> {
    let start = text.find(begin).with_context(|| format!("no line `{begin}`"))? + begin.len();
    let stop = start
        + text[start..].find(end).with_context(|| format!("no line `{end}` after `{begin}`"))?;
    Ok(format!("{}\n{}{}", &text[..start], part, &text[stop..]))
}

/// The template with every `{{query}}` replaced by its figure, the folders read as needed.
fn render(template: &str, dir: &Path, folders: &mut HashMap<String, Matrix>) -> Result<String> {
    let mut out = String::new();
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let len = rest[start..].find("}}").context("a `{{` without `}}`")?;
        let query = &rest[start + 2..start + len];
        out.push_str(&figure(query, dir, folders).with_context(|| format!("`{{{{{query}}}}}`"))?);
        rest = &rest[start + len + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

/// One query's figure.
fn figure(query: &str, dir: &Path, folders: &mut HashMap<String, Matrix>) -> Result<String> {
    let words: Vec<&str> = query.split_whitespace().collect();
    let folder = *words.first().context("an empty query")?;
    if !folders.contains_key(folder) {
        let m = Matrix::load(&dir.join(folder))?
            .with_context(|| format!("results folder `{folder}` has no matrix.json"))?;
        folders.insert(folder.to_string(), m);
    }
    let m = &folders[folder];
    match words[1..] {
        ["depth", policy, "exponent"] => {
            let fits = m.depth_fits();
            let k = fits
                .iter()
                .find(|(p, _)| p == policy)
                .with_context(|| format!("no depth sweep under `{policy}` in `{folder}`"))?
                .1;
            Ok(format!("{k:.2}"))
        }
        ["planner", what] => planner(m, what),
        ["compiled", model, budget, what] => compiled(m, model, budget, what),
        [model, policy, measure] => {
            let r = m
                .find(model, policy)
                .with_context(|| format!("`{folder}` has no record of {model} under {policy}"))?;
            record_figure(m, r, measure)
        }
        _ => bail!(
            "a query is FOLDER MODEL POLICY MEASURE, FOLDER depth POLICY exponent, FOLDER \
             planner MEASURE or FOLDER compiled MODEL BUDGET MEASURE"
        ),
    }
}

/// Lists `(name, what)` pairs for an error message.
fn listed(pairs: &[(&str, &str)]) -> String {
    pairs.iter().map(|(name, what)| format!("{name} ({what})")).collect::<Vec<_>>().join("; ")
}

/// A figure of record `r` of `m`.
fn record_figure(m: &Matrix, r: &Record, measure: &str) -> Result<String> {
    // Figures of a prediction hold for a record that was not run; measured ones need a run.
    match measure {
        "state" => return Ok(size(r.state_bytes())),
        "predicted-total" => {
            return Ok(size(r.predicted_total_bytes.context("the record has no predicted total")?))
        }
        "predicted-time/off" => {
            let projected = m.projections.iter().find(|p| p.model == r.model);
            let row = projected.and_then(|p| p.rows.iter().find(|row| row.label == r.policy));
            let row = row.context("the folder has no projection of the record's policy")?;
            return Ok(format!("{:+.0}%", (row.time_ratio - 1.0) * 100.0));
        }
        _ if !MEASURES.iter().any(|(name, _)| *name == measure) => {
            bail!("unknown measure `{measure}`; the measures are: {}", listed(&MEASURES))
        }
        _ => {}
    }
    if r.status != Status::Ok {
        bail!("{} {} was not measured ({}: {})", r.model, r.policy, r.status, r.error);
    }
    let off = || {
        m.find(&r.model, "off")
            .filter(|o| o.status == Status::Ok)
            .with_context(|| format!("{} has no measured `off`", r.model))
    };
    let torch = || {
        m.find_baseline(&r.model, &r.policy)
            .filter(|b| b.status == Status::Ok)
            .with_context(|| format!("{} {} has no PyTorch baseline", r.model, r.policy))
    };
    let ratio = |a: f64, b: f64| format!("{:.2}", a / b.max(f64::MIN_POSITIVE));
    let change = |x: f64| format!("{:+.0}%", (x - 1.0) * 100.0);
    let rounds = || {
        r.time_vs_off
            .as_ref()
            .with_context(|| format!("{} {} has no timing rounds", r.model, r.policy))
    };
    let data_parallel =
        || anyhow::anyhow!("{} {} is not a data-parallel record", r.model, r.policy);
    Ok(match measure {
        "activation/off" => {
            ratio(r.activation_peak_bytes as f64, off()?.activation_peak_bytes as f64)
        }
        "peak/off" => ratio(r.step_peak_bytes as f64, off()?.step_peak_bytes as f64),
        "total/off" => ratio(r.measured_total() as f64, off()?.measured_total() as f64),
        "time/off" => change(time_vs_off(r, off()?)),
        "time/off-range" => format!("{} to {}", change(rounds()?.min), change(rounds()?.max)),
        "rounds" => rounds()?.rounds.len().to_string(),
        "total" => size(r.measured_total()),
        "total-error" => {
            let predicted = r.predicted_total_bytes.context("the record has no predicted total")?;
            format!("{:+.1}%", (predicted as f64 / r.measured_total() as f64 - 1.0) * 100.0)
        }
        "total-gb" => format!("{:.1} GB", r.measured_total() as f64 / 1e9),
        "saving" => size(off()?.measured_total().saturating_sub(r.measured_total())),
        "state-max-rank" => size(r.model_state_bytes_max_rank.ok_or_else(data_parallel)?),
        "step-peak" => size(r.step_peak_bytes),
        "step-ms" => format!("{:.0}", r.step_ms_median),
        "all-reduce-ms" => format!("{:.0}", r.all_reduce_ms.ok_or_else(data_parallel)?),
        "all-reduce-wait-ms" => format!("{:.0}", r.all_reduce_wait_ms.ok_or_else(data_parallel)?),
        "torch-step-peak" => size(torch()?.step_peak_bytes),
        "torch-step-ms" => format!("{:.0}", torch()?.step_ms_median),
        "peak/torch" => ratio(r.step_peak_bytes as f64, torch()?.step_peak_bytes as f64),
        "time/torch" => {
            let b = torch()?;
            format!(
                "{:.2}",
                b.ours_over_torch
                    .as_ref()
                    .map_or(r.step_ms_median / b.step_ms_median, |s| s.median)
            )
        }
        "time/torch-rounds" => {
            torch()?.ours_over_torch.as_ref().map_or(1, |s| s.rounds.len()).to_string()
        }
        _ => unreachable!("every measure of MEASURES is answered above"),
    })
}

/// A figure of the compiled run of `model` at activation memory budget `budget` ([`COMPILED`]).
fn compiled(m: &Matrix, model: &str, budget: &str, what: &str) -> Result<String> {
    if !COMPILED.iter().any(|(name, _)| *name == what) {
        bail!("unknown compiled measure `{what}`; they are: {}", listed(&COMPILED))
    }
    let policy = format!("memory-budget={budget}");
    let c = m
        .find_compiled(model, &policy)
        .with_context(|| format!("no compiled run of {model} at {policy}"))?;
    if c.status != Status::Ok {
        bail!("{model} {policy} did not compile and run ({}: {})", c.status, c.error);
    }
    let ours = || {
        super::compiled::ours_within(m, c)
            .with_context(|| format!("none of our {model} runs is within {policy}'s step peak"))
    };
    Ok(match what {
        "step-peak" => size(c.step_peak_bytes),
        "step-ms" => format!("{:.0}", c.step_ms_median),
        "compile-s" => format!("{:.0}", c.compile_ms.unwrap_or(0.0) / 1e3),
        "ours" => format!("`{}`", ours()?.policy),
        "ours/compiled" => format!(
            "{:.2}",
            c.ours_over_torch
                .as_ref()
                .map_or(ours()?.step_ms_median / c.step_ms_median, |s| s.median)
        ),
        _ => unreachable!("every measure of COMPILED is answered above"),
    })
}

/// A planner figure of a folder ([`PLANNER`]).
fn planner(m: &Matrix, what: &str) -> Result<String> {
    let errors = m.planner_errors();
    let (worst, worst_record) = *errors
        .iter()
        .max_by(|a, b| a.0.abs().total_cmp(&b.0.abs()))
        .context("no measured record carries a prediction")?;
    Ok(match what {
        "configs" => errors.len().to_string(),
        "within-5%" => errors.iter().filter(|(e, _)| e.abs() <= 0.05).count().to_string(),
        "largest-error" => format!("{:+.1}%", worst * 100.0),
        "worst" => format!("{} {}", worst_record.model, worst_record.policy),
        other => bail!("unknown planner measure `{other}`; they are: {}", listed(&PLANNER)),
    })
}
