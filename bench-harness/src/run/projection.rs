//! The article's A100 table projected at its own sizes by the planner, before (or instead of)
//! running it: each model of the `full` profile projected in a fresh process
//! (`measure::projection`), its projection kept in the results folder. These are predictions,
//! labelled so; where the folder measured the same configuration (`--profile full`), the
//! measurement and the projection's error sit beside them in `TABLE.md`. `gpt2-24gb` predicts its
//! configurations the same way ([`spawn_projection`]).
//!
//! The experiment's other layers: [`crate::measure::projection`] (`project-one`, the projection
//! itself) and [`crate::report::projection`] (its section of `TABLE.md`).

use super::child::{child_error, die_with_parent, pass_overrides};
use super::Existing;
use crate::cli::Common;
use crate::report::record::Projection;
use crate::report::results::{this_command, Matrix};
use crate::workloads::{self, Overrides};
use anyhow::{bail, Result};
use std::process::Command;

/// The `full` profile's models that stand for rows of the article's table.
pub const MODELS: [&str; 4] = ["resnet50", "resnet152", "bert-large", "unet3d-cicek"];

/// Runs `project-one` for every model of the article's table that `models` selects (all where
/// it is empty), in fresh processes, into the matrix; a projection already there is kept or
/// replaced as `existing` says.
pub fn project_all(matrix: &mut Matrix, models: &[String], common: &Common, existing: Existing) {
    for model in MODELS
        .iter()
        .filter(|m| models.is_empty() || models.iter().any(|s| m.starts_with(s.as_str())))
    {
        if existing == Existing::Keep && matrix.projections.iter().any(|p| p.model == *model) {
            continue;
        }
        // At the article's sizes: the command line's sizes are this run's, not the article's.
        match spawn_projection(model, workloads::Profile::Full, common, Overrides::default()) {
            Ok(p) => {
                let off = p.rows.first().map_or(0, |r| r.total_bytes);
                trainkit::say!(
                    "projected {model} at batch {} ({}): off {:.1} GB",
                    p.batch,
                    p.input,
                    off as f64 / 1e9
                );
                matrix.put_projection(p);
            }
            Err(e) => trainkit::say!("projection of {model} failed: {e:#}"),
        }
    }
}

/// `project-one` of `model` of `profile` in a fresh process (a projection builds the model at its
/// size: its memory must not stay in this one), with the changes `overrides` makes to it.
pub fn spawn_projection(
    model: &str,
    profile: workloads::Profile,
    common: &Common,
    overrides: Overrides,
) -> Result<Projection> {
    let exe = std::env::current_exe().expect("own executable");
    let mut cmd = Command::new(exe);
    cmd.args([
        "project-one",
        "--model",
        model,
        "--profile",
        profile.name(),
        "--seed",
        &common.seed.to_string(),
        "--device",
        &common.device.to_string(),
    ]);
    pass_overrides(&mut cmd, overrides);
    die_with_parent(&mut cmd);
    let out = cmd.output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout.lines().last().and_then(|l| serde_json::from_str::<Projection>(l).ok()) {
        Some(p) if out.status.success() => Ok(Projection { command: this_command(), ..p }),
        _ => bail!("{}", child_error(&String::from_utf8_lossy(&out.stderr), out.status)),
    }
}
