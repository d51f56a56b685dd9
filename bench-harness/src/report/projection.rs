//! The article's A100 table projected at its own sizes (`measure::projection`), rendered for
//! `TABLE.md`: predictions, labelled so, beside the measurement and its error where the folder
//! measured the same configuration (`--profile full`).
//!
//! The experiment's other layers: [`crate::run::projection`] (the projections asked for, each in
//! a fresh process) and [`crate::measure::projection`] (`project-one`, the projection itself).

use super::results::{made_by, Matrix};

fn gb(bytes: u64) -> String {
    format!("{:.1} GB", bytes as f64 / 1e9)
}

/// The `TABLE.md` section: every projection of `m` beside the article's figures (`article(model)`:
/// off GB, checkpointed GB, time increase) and, where `m` measured the same model, batch, input
/// and policy, beside the measurement, with the projection's error.
pub fn render(m: &Matrix, article: impl Fn(&str) -> Option<(f64, f64, &'static str)>) -> String {
    let projections = &m.projections;
    if projections.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "\n## Projected at the article's sizes (predictions, beside measurements where they \
         ran)\n\n{}.\n\nThe planner's prediction for the article's configurations: each model \
         built at its full size, its stages profiled one at a time at the full input size, at the \
         article's batch where it is 16 or less, else at batches 8 and 16 and extrapolated (kept \
         bytes are linear in the batch; some kernels' temporaries grow slower, so those \
         projections lean high); the state (weights, optimizer state, inputs) is arithmetic. \
         Totals are the state plus the step's predicted peak, in GB (10^9 bytes, as the article \
         writes them). Time is the predicted step time over `off`'s from this machine's stage \
         times (a CPU ratio, not an A100's). *budget = sqrt's memory*: the plan with the least \
         recompute whose peak fits what `sqrt` needs; *budget=24GiB*: the plan with the least \
         recompute for a 24 GiB card; *least memory*: the plan with the smallest peak. *Measured*: \
         the same configuration run in this folder (state plus step peak), and the projection's \
         error against it. The article's optimizer is not stated: each model trains with its \
         benchmark default (the `optimizer` column: SGD with momentum for the ResNets, AdamW for \
         BERT and the U-Net).\n\n| model | batch | input | optimizer | state | policy or plan | \
         predicted total | / off | predicted time | measured | error | article: off → \
         checkpointing | article: time |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        made_by(projections.iter().map(|p| p.command.as_str()), &m.meta.command)
    );
    for p in projections {
        let off = p.rows.iter().find(|r| r.label == "off").map_or(1, |r| r.total_bytes);
        let art = article(&p.model)
            .map_or("-".to_string(), |(o, c, _)| format!("{o} GB → {c} GB ({:.2})", c / o));
        let art_time = article(&p.model).map_or("-", |(_, _, t)| t);
        for (k, r) in p.rows.iter().enumerate() {
            let policy = if r.plan.is_empty() {
                format!("`{}`", r.label)
            } else {
                format!("{} (`{}`)", r.label, r.plan)
            };
            let (model, batch, input, optimizer, state, a, at) = if k == 0 {
                (
                    p.model.as_str(),
                    p.batch.to_string(),
                    p.input.as_str(),
                    p.optimizer.as_str(),
                    gb(p.state_bytes),
                    art.as_str(),
                    art_time,
                )
            } else {
                ("", String::new(), "", "", String::new(), "", "")
            };
            let measured = m
                .find(&p.model, &r.label)
                .filter(|rec| {
                    rec.status == super::record::Status::Ok
                        && rec.batch == p.batch
                        && rec.input == p.input
                })
                .map(|rec| rec.measured_total());
            let (measured, error) = measured.map_or(("-".into(), "-".into()), |b| {
                (gb(b), format!("{:+.1}%", (r.total_bytes as f64 / b as f64 - 1.0) * 100.0))
            });
            out += &format!(
                "| {model} | {batch} | {input} | {optimizer} | {state} | {policy} | {} | {:.2} | \
                 {:+.0}% | {measured} | {error} | {a} | {at} |\n",
                gb(r.total_bytes),
                r.total_bytes as f64 / off as f64,
                (r.time_ratio - 1.0) * 100.0
            );
        }
    }
    out
}
