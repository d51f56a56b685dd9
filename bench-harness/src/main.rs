//! `bench-harness`: runs models x checkpointing policies, each configuration in a fresh process;
//! checks every policy's gradients, `off`'s too, bit for bit against plain candle; measures peak
//! memory and step time; writes `results/<profile>-<device>/matrix.{json,csv,md}`.
//!
//! It measures; it does not train to convergence (that is what the trainers are for). The
//! modules, from the leaves up: `workloads` (what can be measured: the models and profiles) and
//! `cli` (the flags); `report` (what a results folder holds and how it is shown: tables, plots,
//! the claims ledger); `measure` (one configuration measured in this process); `run` (how the
//! matrix runs: each configuration in a fresh process, PyTorch beside it, timing rounds). Each
//! imports only from those before it.

mod cli;
mod measure;
mod report;
mod run;
mod workloads;

use anyhow::Result;
use clap::{Parser, Subcommand};
use cli::{Common, MatrixArgs};
use measure::One;
use remat::memory::CountingAlloc;
use remat::PolicyRequest;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[derive(Parser)]
#[command(
    about = "Checkpointing benchmark: models x policies, bit-exact gradient checks, memory and time"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    matrix: MatrixArgs,
}

#[derive(Subcommand)]
enum Cmd {
    /// Check the device before a long run: tensor ops, conv2d, backward, the memory meter, and a
    /// bit-exact gradient check; prints one JSON line and fails on any problem.
    Selftest {
        #[arg(long, default_value = "cpu")]
        device: trainkit::DeviceName,
    },
    /// Render `results/CLAIMS.md`, the ledger of the article's claims, from its template
    /// `CLAIMS.template.md`: every figure in it is a query of a results folder.
    Claims {
        /// The results folder that holds the template and the folders it queries.
        #[arg(long, default_value = "results")]
        dir: std::path::PathBuf,
        /// Change nothing: fail unless the ledger is what its template and the results give.
        #[arg(long)]
        check: bool,
    },
    /// Time every convolution the `cpu` profile's models run (recorded from their forward
    /// passes): forward, input and weight gradients, beside PyTorch's on the same shapes
    /// (`scripts/torch_ops.py`), into `convs.{json,md}`.
    Kernels(run::kernels::KernelArgs),
    /// Predict one model of the `full` profile at its size and print the projection as JSON
    /// (the matrix runs this for the article's table).
    #[command(hide = true)]
    ProjectOne {
        #[arg(long)]
        model: String,
        #[command(flatten)]
        common: Common,
    },
    /// Measure one configuration and print its record as JSON (the matrix runs this per config).
    #[command(hide = true)]
    RunOne {
        #[arg(long)]
        model: String,
        #[arg(long)]
        policy: PolicyRequest,
        /// Time the steps only: no prediction, no gradient check (the interleaved timing rounds).
        #[arg(long)]
        time_only: bool,
        /// Measure and predict, but skip the gradient check (where two more models do not fit).
        #[arg(long)]
        no_check: bool,
        /// Predict only: profile the stages and print the record with the prediction, run no step.
        #[arg(long)]
        dry_run: bool,
        /// A folder where the policies of a model share one profile (the matrix's
        /// `<out>/profiles`): read where one measured for this configuration and commit is there,
        /// else measured and written.
        #[arg(long)]
        profiles: Option<std::path::PathBuf>,
        #[command(flatten)]
        common: Common,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Some(Cmd::RunOne { model, policy, time_only, no_check, dry_run, profiles, common }) => {
            let mode = match (dry_run, time_only, no_check) {
                (true, _, _) => One::DryRun,
                (_, true, _) => One::TimeOnly,
                (_, _, true) => One::Unchecked,
                _ => One::Full,
            };
            measure::run_one(&model, &policy, mode, profiles.as_deref(), &common)
        }
        Some(Cmd::ProjectOne { model, common }) => {
            measure::projection::project_one(&model, &common)
        }
        Some(Cmd::Selftest { device }) => measure::selftest::selftest(device),
        Some(Cmd::Claims { dir, check }) => report::claims::run(&dir, check),
        Some(Cmd::Kernels(args)) => run::kernels::run(&args),
        None => run::matrix::run(cli.matrix),
    }
}
