//! Ctrl-C during training: the first finishes the step under way, writes the training snapshot
//! (with `--save`) and ends the run with exit 130, as a shell reports SIGINT; a second ends it at
//! once. Without this the steps since the last `--save-every` were lost.

use crate::parallel::Group;
use anyhow::Result;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set by the first Ctrl-C.
static REQUESTED: AtomicBool = AtomicBool::new(false);

/// The exit status of a run ended by Ctrl-C: 128 + SIGINT.
pub const EXIT: i32 = 130;

/// The error a run ended by Ctrl-C returns, once its snapshot is written: [`crate::main`] exits
/// with [`EXIT`].
#[derive(Debug)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted")
    }
}

impl std::error::Error for Interrupted {}

/// Catches Ctrl-C from now on (once per process: a later call keeps the first handler).
pub fn catch() -> Result<()> {
    static CAUGHT: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    if CAUGHT.set(()).is_err() {
        return Ok(());
    }
    ctrlc::set_handler(|| {
        if REQUESTED.swap(true, Ordering::SeqCst) {
            crate::say!("interrupted again: ending now, without a snapshot");
            std::process::exit(EXIT);
        }
        crate::say!(
            "interrupted: finishing this step and writing the training snapshot (Ctrl-C again \
             ends at once)"
        );
    })?;
    Ok(())
}

/// Whether a Ctrl-C asks the run to stop: on any rank, so that all stop after the same step (a
/// sharded optimizer's snapshot needs every rank).
pub fn requested(group: &Group) -> Result<bool> {
    let mine = REQUESTED.load(Ordering::SeqCst);
    if group.world() == 1 {
        return Ok(mine);
    }
    Ok(group.mean_of(if mine { 1.0 } else { 0.0 })? > 0.0)
}
