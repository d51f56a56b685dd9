//! What a run tells its user and writes down: the progress bar, one line per step (loss, time,
//! peak memory), `--log-json` records, evaluations, and the summary at the end (median step time,
//! all-reduce time); and reading a `--log-json` file back.

use crate::parallel::Group;
use crate::say;
use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use remat::memory::mib;
use remat::memory::Usage;
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};

/// One line of `--log-json` after a training step.
#[derive(Serialize)]
struct StepRecord {
    step: usize,
    loss: f32,
    step_ms: f64,
    micro_batches: usize,
    heap_base_bytes: u64,
    heap_peak_delta_bytes: u64,
    rss_peak_delta_bytes: Option<u64>,
    /// Data-parallel ranks (the loss is their mean; memory is rank 0's).
    ranks: usize,
    /// The largest rank's step peak, with several ranks.
    #[serde(skip_serializing_if = "Option::is_none")]
    heap_peak_delta_max_bytes: Option<u64>,
    /// Time in gradient all-reduces this step, and the part the training thread waited for.
    #[serde(skip_serializing_if = "Option::is_none")]
    all_reduce_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    all_reduce_wait_ms: Option<f64>,
}

/// One line of `--log-json` after an evaluation.
#[derive(Serialize)]
struct EvalRecord {
    step: usize,
    eval_loss: f32,
    eval_batches: usize,
}

/// The progress bar, the printed lines and `--log-json` of one run (rank 0 writes the file).
pub struct Log<'g> {
    group: &'g Group,
    /// Communication time when the last step was logged.
    comm: collective::CommTime,
    bar: ProgressBar,
    /// `--log-json` and its file.
    json: Option<(PathBuf, std::fs::File)>,
    micro_batches: usize,
    times: Vec<f64>,
}

/// What a run does with a `--log-json` file that exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFile {
    /// A new run: the file starts empty.
    New,
    /// A resumed run at step `from`: its steps follow those of the run it resumes, whose records
    /// of step `from` on (steps the snapshot does not hold, trained again now) are dropped.
    Continue { from: usize },
}

impl<'g> Log<'g> {
    /// A log of `steps` optimizer steps of `micro_batches` micro-batches each, writing `log_json`
    /// on rank 0; a resumed run ([`LogFile::Continue`]) continues the file of the run it resumes.
    pub fn new(
        group: &'g Group,
        steps: usize,
        micro_batches: usize,
        log_json: Option<&Path>,
        file: LogFile,
    ) -> Result<Self> {
        let bar = ProgressBar::new(steps as u64).with_style(ProgressStyle::with_template(
            "{bar:30} {pos}/{len} steps [{elapsed} < {eta}] {msg}",
        )?);
        let json = match log_json.filter(|_| group.is_root()) {
            Some(p) => {
                let context = || format!("--log-json {}", p.display());
                if let LogFile::Continue { from } = file {
                    keep_before(p, from).with_context(context)?;
                }
                let open = std::fs::OpenOptions::new()
                    .create(true)
                    .write(true)
                    .append(file != LogFile::New)
                    .truncate(file == LogFile::New)
                    .open(p);
                Some((p.to_path_buf(), open.with_context(context)?))
            }
            None => None,
        };
        Ok(Log { group, comm: group.comm_time(), bar, json, micro_batches, times: Vec::new() })
    }

    /// Prints a line without breaking the bar (`suspend` prints whether or not the bar is drawn:
    /// it is hidden when stderr is no terminal).
    pub fn say(&self, line: std::fmt::Arguments) {
        self.bar.suspend(|| say!("{line}"));
    }

    /// Moves the bar to `step` (a resumed run).
    pub fn start_at(&self, step: usize) {
        self.bar.set_position(step as u64);
    }

    /// After a training step: its line, the bar, and its `--log-json` record.
    pub fn step(&mut self, step: usize, loss: f32, usage: &Usage) -> Result<()> {
        self.times.push(usage.elapsed_ms);
        let rss = usage.rss_peak_delta.map_or("n/a".into(), |b| format!("{:.1} MiB", mib(b)));
        self.say(format_args!(
            "step {step:>4}  loss {loss:.4}  {:>8.1} ms  peak +{:.1} MiB (rss +{rss})",
            usage.elapsed_ms,
            mib(usage.heap_peak_delta)
        ));
        self.bar.set_message(format!("loss {loss:.3}"));
        self.bar.inc(1);
        let (now, before) =
            (self.group.comm_time(), std::mem::replace(&mut self.comm, self.group.comm_time()));
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let parallel = (self.group.world() > 1)
            .then(|| (ms(now.all_reduce - before.all_reduce), ms(now.waited - before.waited)));
        let peaks = if self.group.world() > 1 {
            Some(self.group.min_max(usage.heap_peak_delta)?)
        } else {
            None
        };
        if self.json.is_some() {
            let rec = StepRecord {
                step,
                loss,
                step_ms: usage.elapsed_ms,
                micro_batches: self.micro_batches,
                heap_base_bytes: usage.heap_base,
                heap_peak_delta_bytes: usage.heap_peak_delta,
                rss_peak_delta_bytes: usage.rss_peak_delta,
                ranks: self.group.world(),
                heap_peak_delta_max_bytes: peaks.map(|p| p.1),
                all_reduce_ms: parallel.map(|p| p.0),
                all_reduce_wait_ms: parallel.map(|p| p.1),
            };
            self.write_json(&rec)?;
        }
        Ok(())
    }

    /// After an evaluation of `batches` batches: its line and record.
    pub fn eval(&mut self, step: usize, eval_loss: f32, eval_batches: usize) -> Result<()> {
        self.say(format_args!(
            "eval after step {step}: loss {eval_loss:.4} ({eval_batches} evaluation batches)"
        ));
        self.write_json(&EvalRecord { step, eval_loss, eval_batches })
    }

    /// Appends `record` as one line to `--log-json`, if given; an error names the file (a full
    /// disk says only "No space left on device").
    fn write_json(&mut self, record: &impl Serialize) -> Result<()> {
        let Some((path, f)) = self.json.as_mut() else { return Ok(()) };
        writeln!(f, "{}", serde_json::to_string(record)?)
            .and_then(|()| f.flush())
            .with_context(|| format!("--log-json {}", path.display()))
    }

    /// Clears the bar; prints the time spent in all-reduces and the median step time (the
    /// first, warm-up step excluded).
    pub fn finish(self) {
        self.bar.finish_and_clear();
        let comm = self.group.comm_time();
        if self.group.world() > 1 {
            let (busy, waited) =
                (comm.all_reduce.as_secs_f64() * 1e3, comm.waited.as_secs_f64() * 1e3);
            say!(
                "all-reduce: {busy:.1} ms in all-reduce calls; the training thread waited \
                 {waited:.1} ms for the means ({:.1} MiB of f32 per rank)",
                mib(comm.floats * 4)
            );
        }
        if self.times.len() > 1 {
            let mut t = self.times[1..].to_vec();
            t.sort_by(f64::total_cmp);
            say!("median step time after warm-up: {:.1} ms", t[t.len() / 2]);
        }
    }
}

/// Drops the records of step `from` on from the log `path`, where it exists, and a last line cut
/// short: a run stopped after its last snapshot logged steps its resume trains again.
fn keep_before(path: &Path, from: usize) -> std::io::Result<()> {
    let text = match std::fs::read_to_string(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        other => other?,
    };
    let before = |line: &&str| {
        let record = serde_json::from_str::<serde_json::Value>(line).ok();
        record.and_then(|r| r.get("step")?.as_u64()).is_some_and(|step| step < from as u64)
    };
    let kept: String = text.lines().filter(before).map(|line| format!("{line}\n")).collect();
    if kept.len() == text.len() {
        return Ok(());
    }
    // Written beside and renamed over it: an interruption keeps the whole log.
    params::write_atomically(path, |tmp| Ok(std::fs::write(tmp, kept)?))
        .map_err(std::io::Error::other)
}

/// The training losses of a `--log-json` file, in step order (evaluation lines skipped).
pub fn read_losses(path: &Path) -> Result<Vec<f32>> {
    read_log(path, "loss")
}

/// The evaluation losses of a `--log-json` file, in step order.
pub fn read_eval_losses(path: &Path) -> Result<Vec<f32>> {
    read_log(path, "eval_loss")
}

/// The values of `field` in the lines of a `--log-json` file that have it.
fn read_log(path: &Path, field: &str) -> Result<Vec<f32>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut values = Vec::new();
    for line in text.lines() {
        let record: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}: not a log line: {line}", path.display()))?;
        if let Some(v) = record.get(field).and_then(|v| v.as_f64()) {
            values.push(v as f32);
        }
    }
    Ok(values)
}
