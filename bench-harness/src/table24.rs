//! `TABLE.md` of `--matrix gpt2-24gb`: for GPT-2 at every published size, batch 1 with 8
//! micro-batches accumulated, each way of holding its state and each policy: the predicted bytes
//! (with the state's arithmetic), the measured peak, whether it fits 24 GiB, and tokens per
//! second. The article claims GPT-2 1.5B trains on a 24 GB card this way in 21 GB.

use crate::measure::{Record, Status};
use crate::predict::Prediction;
use crate::results::Matrix;
use std::fmt::Write as _;

const GIB_24: u64 = 24 << 30;

fn gib(bytes: u64) -> String {
    format!("{:.2}", crate::report::gib(bytes))
}

/// Everything the step held at its peak: the state before it (parameters, optimizer state,
/// inputs) and the step's peak above that (gradients, activations, temporaries).
pub fn measured_total(r: &Record) -> u64 {
    r.model_state_bytes + r.step_peak_bytes
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
        (Status::Ok, _) => if measured_total(r) <= GIB_24 { "**yes**" } else { "no" }.into(),
        // The kernel, not the cap: the process's resident memory outgrew the machine.
        (Status::Oom, p) if r.error.contains("SIGKILL") => {
            format!("not measured: killed by the kernel (this machine's memory){}", p.map_or(String::new(), |p| format!("; predicted {} GiB", gib(p))))
        }
        (Status::Oom, _) => "no (out of memory under the cap)".into(),
        (Status::Skipped, Some(p)) if p <= GIB_24 => "predicted yes".into(),
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
    let bytes = r.dtype.parse::<layers::Precision>().map_or(4, |d| d.weights().size_in_bytes() as u64);
    let params = p.params / bytes;
    let per_rank = |ranks: u64| gib(p.params + p.grads + p.optimizer.div_ceil(ranks));
    format!(
        "| {model} | {variant} | {params} | {} | {} | {} | {} | {} | {} |",
        gib(p.params),
        gib(p.grads),
        gib(p.optimizer),
        gib(p.params + p.grads + p.optimizer),
        per_rank(2),
        per_rank(4)
    )
}

pub fn render(m: &Matrix) -> String {
    let meta = &m.meta;
    let first = m.records.first();
    let (input, accumulate) = first.map_or(("?".into(), 0), |r| (r.input.clone(), r.accumulate));
    let mut out = format!(
        "# GPT-2 on 24 GiB: state, precision, optimizer and checkpointing, measured\n\n\
         {}  \nMachine: {}  \ncandle {}, commit {}, profile `{}`\n\n\
         Every configuration trains at batch 1, {input}, with {accumulate} micro-batches accumulated per optimizer step \
         (effective batch {accumulate}). Variants: `f32-adamw` (everything f32), `bf16-adamw` (bf16 activations, f32 parameters, \
         gradients and AdamW moments), `bf16-weights-adamw` (bf16 activations, parameters and gradients, f32 AdamW moments: \
         no f32 master copy), `bf16-adafactor` (bf16 activations, f32 parameters and gradients, Adafactor's factored \
         second moment).\n\n",
        crate::results::made_by(m.records.iter().map(|r| r.command.as_str()), &meta.command),
        meta.machine,
        meta.candle_version,
        meta.git_commit,
        meta.profile
    );
    out += "## The model state, by arithmetic\n\n\
            Parameters and gradients 4 bytes each (2 under `bf16-weights-adamw`); AdamW 8 bytes per parameter; Adafactor 4 bytes per row and per column of each \
            weight matrix (per element of a vector). Computed from the parameter shapes, not measured. The last two columns are \
            one rank's state when the optimizer state is sharded over 2 or 4 data-parallel ranks (`--ranks N --shard-optimizer`, \
            ZeRO stage 1: every rank still holds all parameters and gradients).\n\n\
            | model | variant | parameters | params GiB | grads GiB | optimizer GiB | state GiB | per rank, sharded over 2 | over 4 |\n|---|---|---|---|---|---|---|---|---|\n";
    let records = in_size_order(m);
    let mut seen = Vec::new();
    for r in &records {
        let (Some(p), Some((model, variant))) = (r.predicted, r.model.split_once('/')) else { continue };
        if !seen.contains(&r.model) {
            seen.push(r.model.clone());
            let _ = writeln!(out, "{}", state_row(r, model, variant, &p));
        }
    }
    out += "\n## Predicted against measured\n\n\
            Predicted total: the state above plus the activations scaled from gpt2-small's measured activation peak under the same \
            variant and policy (its logits recomputed for each model, its blocks scaled by width times the blocks the policy keeps: \
            L, or sqrt(L) under `sqrt`); gpt2-small is the calibration and has no prediction of its own. Measured total: the heap \
            before the step (parameters, optimizer state) plus the step's peak above it (gradients, activations), the highest \
            over the timed steps. Configurations predicted above the memory cap are not run; with `--dry-run`, none is, and every \
            row but the calibration's is a prediction. The meter counts live bytes; the allocator keeps freed pages for reuse \
            (a step faults in no new memory), so a process's resident memory runs above its live heap (by 3-4 GiB for GPT-2 XL): \
            near a machine's limit the kernel may kill a run whose live heap fits, which the table says.\n\n\
            | model | variant | policy | predicted GiB | measured GiB | error | fits 24 GiB | tokens/s | step time | gradients |\n\
            |---|---|---|---|---|---|---|---|---|---|\n";
    for r in &records {
        let (model, variant) = r.model.split_once('/').unwrap_or((&r.model, ""));
        let predicted = r.predicted_total_bytes.map_or("calibration".into(), gib);
        let seq = r.input.trim_start_matches("seq ").parse::<usize>().unwrap_or(0);
        let (measured, error, tokens, time) = if r.status == Status::Ok {
            let total = measured_total(r);
            let error = r.predicted_total_bytes.map_or("-".into(), |p| format!("{:+.1}%", (p as f64 / total as f64 - 1.0) * 100.0));
            let tokens = (r.batch * r.accumulate * seq) as f64;
            let mark = if returned_freed_memory(r) { " †" } else { "" };
            (gib(total), error, format!("{:.1}{mark}", tokens / (r.step_ms_median / 1000.0)), format!("{:.1} s{mark}", r.step_ms_median / 1000.0))
        } else {
            (format!("not run: {}", r.error), "-".into(), "-".into(), "-".into())
        };
        let grads = match (r.status, r.grads_checked, r.grads_bit_identical) {
            (Status::Ok, true, true) => "= plain candle",
            (Status::Ok, true, false) => "DIFFER",
            (Status::Ok, false, _) => "not checked (memory)",
            _ => "-",
        };
        let _ = writeln!(out, "| {model} | {variant} | {} | {predicted} | {measured} | {error} | {} | {tokens} | {time} | {grads} |", r.policy, fits(r));
    }
    let fit: Vec<String> = records
        .iter()
        .filter(|r| r.status == Status::Ok && measured_total(r) <= GIB_24)
        .map(|r| format!("{} `{}` ({} GiB)", r.model, r.policy, gib(measured_total(r))))
        .collect();
    if records.iter().any(|r| r.status == Status::Ok && returned_freed_memory(r)) {
        out += "\n† Measured with `--return-freed-memory` (freed memory given back to the OS at once, so that resident memory \
                stays near the live heap on this machine): every step faults its pages in again, so its time is not comparable \
                with the other rows'.\n";
    }
    let _ = write!(out, "\n## Fits 24 GiB at batch 1 (measured)\n\n{}\n", if fit.is_empty() { "None.".into() } else { fit.join(", ") });
    out
}
