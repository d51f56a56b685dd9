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
//!
//! # Experiments, layer by layer
//!
//! Cut by layer, one experiment's code lies in several of those folders. Here is each experiment
//! (a `--matrix` value, a flag that adds to a matrix, or a command) with its files, layer by
//! layer; `main.rs` (the commands) and `cli.rs` (the flags) serve them all. Each experiment's
//! file names its siblings in the other layers; `docs/architecture.md` has the same table.
//!
//! | experiment | file | what the file does for it |
//! |---|---|---|
//! | `--matrix models` | `workloads.rs` | `profile`: the models; `Workload::policies`: theirs |
//! | | `run/matrix.rs` | selects, refuses a mixed folder, resumes, runs each, saves |
//! | | `run/child.rs` | `spawn_one`: a fresh `run-one` process; its record, or `oom`/error |
//! | | `measure/one.rs` | `run-one`: timed steps, the prediction, the gradient check |
//! | | `report/record.rs` | `Record`: one configuration's figures |
//! | | `report/results.rs` | `Matrix`: `matrix.json`, and the questions asked of it |
//! | | `report/mod.rs` | `save`: every file of the folder; `matrix.csv`, `matrix.md` |
//! | | `report/table.rs` | `TABLE.md`: the article's table beside ours |
//! | | `report/plot.rs` | the `tradeoff` and `timelines` figures |
//! | `--matrix depth` | `workloads.rs` | `depth_sweep`: GPT-2 stacks `depth-<L>`, `off`, `sqrt` |
//! | | `run/`, `measure/` | as `models`: `matrix.rs`, `child.rs`, `one.rs` |
//! | | `report/results.rs` | `depth_fits`: the exponent of activation peak against depth |
//! | | `report/table.rs` | `TABLE.md`'s depth sweep |
//! | | `report/plot.rs` | the `depth` figure |
//! | `--matrix all` | | `models` and `depth` (the default) |
//! | `--rounds`, `--retime` | `run/rounds.rs` | `time_rounds`: the interleaved rounds, their ratios stored |
//! | | `measure/one.rs` | `One::TimeOnly`: the steps timed, nothing else |
//! | | `report/record.rs` | `Spread`: time / off over the rounds |
//! | `--dry-run` | `run/matrix.rs` | every configuration predicted in a child and printed |
//! | | `measure/one.rs` | `One::DryRun`: the planner's prediction, no step |
//! | projections | `run/projection.rs` | `project_all`: each of the article's models, a process |
//! | | `measure/projection.rs` | `project-one`: profiled at full size, every policy predicted |
//! | | `report/record.rs` | `Projection` |
//! | | `report/projection.rs` | `TABLE.md`'s projections, beside what the folder measured |
//! | `--matrix gpt2-24gb` | `workloads.rs` | GPT-2 small to XL in each of `STATE_VARIANTS` |
//! | | `run/fits_24gb.rs` | defaults; each predicted, skipped above the cap, else run |
//! | | `run/projection.rs` | `spawn_projection`: the projection its predictions come from |
//! | | `run/`, `measure/` | as `models`: `matrix.rs`, `child.rs`, `one.rs` |
//! | | `measure/projection.rs` | `project-one` at the configuration's own size |
//! | | `report/record.rs` | `Prediction`: the state by arithmetic, the activations |
//! | | `report/fits_24gb.rs` | its `TABLE.md` (what fits, the smallest change) and `memory` figure |
//! | `--matrix llm-24gb` | `workloads.rs` | Llama-family 0.5B-8B x seq 2048/4096 x `LLM_VARIANTS` |
//! | | (the rest) | as `gpt2-24gb`; `measure/projection.rs` builds two blocks, deepens the profile |
//! | `--baseline pytorch` | `run/baseline.rs` | `scripts/torch_baseline.py` on one configuration |
//! | | `run/matrix.rs` | `baseline_beside`: PyTorch right after ours, and in the rounds |
//! | | (`measure/`: none) | the script measures PyTorch |
//! | | `report/record.rs` | `Baseline`: PyTorch's row |
//! | | `report/baseline.rs` | side by side in `matrix.md` and `TABLE.md`; GFLOP/s |
//! | | `report/mod.rs` | PyTorch's rows of `matrix.csv` |
//! | `--ranks N` | `run/child.rs` | `run-one` under `mpirun` |
//! | | `measure/one.rs` | all-reduce times, the largest rank's peaks |
//! | | `report/mod.rs` | `matrix.md`'s ranks table |
//! | `--fused-path generic` | `run/child.rs` | passes the route to `run-one` |
//! | | `measure/one.rs` | sets the route; the record names it |
//! | `--matrix render` | `run/matrix.rs` | reads `matrix.json`, runs nothing |
//! | | `report/` | `save` and every writer it calls |
//! | `kernels` | `run/kernels.rs` | the flags; rounds of ours and `scripts/torch_ops.py --convs` |
//! | | `measure/kernels.rs` | a model's convolutions from its forward; each part timed |
//! | | `report/kernels.rs` | `KernelReport`: `convs.json` and `convs.md` |
//! | `selftest` | `measure/selftest.rs` | the device's ops, the meter, `one.rs`'s gradient check |
//! | `claims` | `report/claims.rs` | `CLAIMS.md`, README's table: queries of results folders |

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
        Some(Cmd::Claims { dir, check }) => {
            let action =
                if check { report::claims::Action::Check } else { report::claims::Action::Write };
            report::claims::run(&dir, action)
        }
        Some(Cmd::Kernels(args)) => run::kernels::run(&args),
        None => run::matrix::run(cli.matrix),
    }
}
