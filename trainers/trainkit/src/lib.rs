//! `trainkit`: what the four trainer binaries share, so each is its model, its data and its
//! flags. [`Trainer::run`] owns the loop; one optimizer step ([`Stepper`]) is what the trainers
//! and the harness's measurement both run. By job:
//! - [`recipe`]: the one training path, from a trainer's command line ([`Recipe`]: what is its
//!   own) to a trained model ([`main`], [`train`]);
//! - [`args`]: the flags every trainer shares ([`RunArgs`]), their defaults and their checks;
//! - [`plan`]: the policy planned before training, the fit check, `--dry-run`;
//! - [`step`]: one optimizer step of gradient accumulation, measured;
//! - [`scaler`]: f16 loss scaling;
//! - [`snapshot`]: training snapshots that `--resume` continues, and the outputs' checks;
//! - [`inputs`]: the files a run reads, checked before anything is built;
//! - [`interrupt`]: Ctrl-C, which ends a run after its step and its snapshot;
//! - [`log`]: the progress bar, the per-step lines and `--log-json`;
//! - [`trainer`]: the loop;
//! - [`lora`]: `--lora` and its flags (GPT-2, BERT);
//! - [`text`]: a causal language model's data flags (`--seq`, `--data`, `--text`);
//! - [`hub`]: pre-trained weights and the Hugging Face hub; [`parallel`]: data parallelism over
//!   the ranks of a `collective::Group`.
//!
//! Not here: the models, their data, the test helpers (the `testkit` crate).

pub mod args;
pub mod hub;
pub mod inputs;
pub mod interrupt;
pub mod log;
pub mod lora;
pub mod parallel;
pub mod plan;
pub mod recipe;
pub mod scaler;
pub mod snapshot;
pub mod step;
pub mod text;
pub mod trainer;

pub use args::{Defaults, DeviceName, RunArgs};
pub use hub::Sources;
pub use log::{read_eval_losses, read_losses};
pub use parallel::{launch, optimizer, or_abort, Group};
pub use plan::{
    auto_budget, available_memory, build_model, check_footprint, free_memory, memory_before_step,
    rank_seed,
};
pub use recipe::{main, train, Flags, Recipe};
pub use scaler::{finish_gradients, LossScaler};
pub use snapshot::{data_source, Output};
pub use step::{micro_batches, StepOutcome, Stepper};
pub use trainer::Trainer;

use std::io::Write;

/// Set on every rank but the first of a data-parallel run: rank 0 speaks for all.
static QUIET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Where a line a run says goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    /// What the run was asked for (`--dry-run`'s prediction): `println!`'s stream.
    Stdout,
    /// Progress, warnings and errors: `eprintln!`'s stream.
    Stderr,
}

/// Writes one line to `stream`, ending the process quietly when the reader has closed the
/// pipe (`train-gpt2 ... 2>&1 | head -2`), where `eprintln!` would panic: with exit 141, as a
/// process killed by SIGPIPE, since the run did not do its work (exit 0 would tell a script it
/// had); on any other write error (`> /dev/full`) with exit 1, saying so on stderr.
pub fn say_line(stream: Stream, args: std::fmt::Arguments) {
    if QUIET.load(std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    // One write per line: ranks and child processes share the stream, and a line written in
    // pieces interleaves with theirs.
    let line = format!("{args}\n");
    let result = match stream {
        Stream::Stdout => {
            let mut out = std::io::stdout().lock();
            out.write_all(line.as_bytes()).and_then(|_| out.flush())
        }
        Stream::Stderr => std::io::stderr().lock().write_all(line.as_bytes()),
    };
    match result {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            std::process::exit(CLOSED_PIPE_EXIT)
        }
        // A full disk or device: what the run says is lost, so it has not done its work.
        Err(e) => {
            let stream = match stream {
                Stream::Stdout => "standard output",
                Stream::Stderr => "standard error",
            };
            let _ = writeln!(std::io::stderr(), "error: writing to {stream}: {e}");
            std::process::exit(1);
        }
    }
}

/// The exit status of a run whose output pipe was closed: 128 + SIGPIPE, a shell's status for a
/// process that signal ended.
pub const CLOSED_PIPE_EXIT: i32 = 141;

/// `eprintln!` that ends quietly on a closed pipe ([`say_line`]).
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => { $crate::say_line($crate::Stream::Stderr, format_args!($($arg)*)) };
}

/// `println!` that ends quietly on a closed pipe ([`say_line`]).
#[macro_export]
macro_rules! show {
    ($($arg:tt)*) => { $crate::say_line($crate::Stream::Stdout, format_args!($($arg)*)) };
}

/// The text file `path` that `flag` names, whole. Refused unless it is a regular file: a device
/// such as `/dev/zero` would be read until memory ran out, a pipe until its writer closed.
pub fn read_text(flag: &str, path: &std::path::Path) -> anyhow::Result<String> {
    use anyhow::Context;
    let meta = std::fs::metadata(path).with_context(|| format!("{flag} {}", path.display()))?;
    if !meta.is_file() {
        anyhow::bail!("{flag} {} is not a regular file; give a text file", path.display());
    }
    std::fs::read_to_string(path).with_context(|| format!("{flag} {}", path.display()))
}

/// "1 segment", "3 segments": what a log line says of a cut.
pub fn segments(n: usize) -> String {
    format!("{n} segment{}", if n == 1 { "" } else { "s" })
}
