//! Every configuration runs in a fresh process of this binary (`run-one`, `project-one`), so
//! one run's peak never leaks into another's: starting it, reading its record back, and telling an
//! out-of-memory end from an error.
//!
//! What runs in the child: [`crate::measure::one`] (`run-one`) and [`crate::measure::projection`]
//! (`project-one`).

use crate::cli::Common;
use crate::measure::One;
use crate::report::record::{Record, Status};
use crate::workloads::{Overrides, Profile, Workload};
use remat::PolicyRequest;
use std::path::Path;
use std::process::Command;

/// Runs one configuration in a fresh process, so one run's peak never leaks into another.
/// `profiles`: the folder where the model's policies share one planner profile.
pub fn spawn_one(
    w: &Workload,
    policy: &PolicyRequest,
    common: &Common,
    (profile, profiles): (Profile, Option<&Path>),
    mode: One,
) -> Record {
    let mut cmd = run_one_command(w, policy, common, (profile, profiles), mode);
    die_with_parent(&mut cmd);
    let failed = |status: Status, error: String| Record {
        status,
        error,
        ..Record::new(w, policy, &common.device.to_string())
    };
    let out = match cmd.output() {
        Ok(out) => out,
        Err(e) => {
            let program = cmd.get_program().to_string_lossy().into_owned();
            return failed(Status::Error, format!("could not start {program}: {e}"));
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    if out.status.success() {
        if let Some(rec) =
            stdout.lines().last().and_then(|l| serde_json::from_str::<Record>(l).ok())
        {
            return rec;
        }
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Our allocator names the phase of a refused allocation; otherwise the runtime's line.
    let oom_line =
        stderr.lines().find(|l| l.starts_with(remat::memory::CAP_REFUSAL)).or_else(|| {
            stderr.lines().find(|l| {
                ["memory allocation of", "out of memory", "OUT_OF_MEMORY"]
                    .iter()
                    .any(|s| l.contains(s))
            })
        });
    #[cfg(unix)]
    let killed = std::os::unix::process::ExitStatusExt::signal(&out.status) == Some(9);
    #[cfg(not(unix))]
    let killed = false;
    match (oom_line, killed) {
        (Some(line), _) => failed(Status::Oom, line.trim().to_string()),
        (None, true) => failed(Status::Oom, "killed by SIGKILL (the kernel's OOM killer?)".into()),
        _ => failed(Status::Error, child_error(&stderr, out.status)),
    }
}

/// The `run-one` command line of a configuration: this binary (under mpirun with `--ranks`) with
/// the flags of the workload, the policy and the run.
fn run_one_command(
    w: &Workload,
    policy: &PolicyRequest,
    common: &Common,
    (profile, profiles): (Profile, Option<&Path>),
    mode: One,
) -> Command {
    let exe = std::env::current_exe().expect("own executable");
    let mut cmd = if common.ranks > 1 {
        trainkit::parallel::mpirun(common.ranks, &exe)
    } else {
        Command::new(exe)
    };
    cmd.args(["run-one", "--model", &w.model, "--policy", &policy.to_string()])
        .args(["--profile", profile.name(), "--steps", &common.steps.to_string()])
        .args(["--seed", &common.seed.to_string(), "--device", &common.device.to_string()]);
    if let Some(cap) = common.memory_cap {
        cmd.args(["--memory-cap", &cap.to_string()]);
    }
    if let Some(dir) = profiles {
        cmd.arg("--profiles").arg(dir);
    }
    pass_overrides(&mut cmd, common.overrides());
    if common.no_rng_replay {
        cmd.arg("--no-rng-replay");
    }
    if common.fused_path == crate::cli::FusedPath::Generic {
        cmd.args(["--fused-path", "generic"]);
    }
    if common.shard_optimizer {
        cmd.arg("--shard-optimizer");
    }
    if common.return_freed_memory {
        cmd.env("MIMALLOC_PURGE_DELAY", "0");
    }
    let mode_flag = match mode {
        One::Full => None,
        One::TimeOnly => Some("--time-only"),
        One::Unchecked => Some("--no-check"),
        One::DryRun => Some("--dry-run"),
    };
    cmd.args(mode_flag);
    cmd
}

/// Gives `cmd` (a `run-one` or `project-one`) the changes `o` makes to a workload.
pub fn pass_overrides(cmd: &mut Command, o: Overrides) {
    let flags = [
        ("--batch", o.batch.map(|b| b.to_string())),
        ("--input-size", o.input_size.map(|n| n.to_string())),
        ("--accumulate", o.accumulate.map(|n| n.to_string())),
        ("--optimizer", o.optimizer.map(|k| k.to_string())),
        ("--dtype", o.dtype.map(|d| d.to_string())),
    ];
    for (flag, value) in flags {
        if let Some(v) = value {
            cmd.args([flag, &v]);
        }
    }
}

/// What a failed child process said: anyhow's "Error: ..." line, not the backtrace
/// RUST_BACKTRACE appends; else its last line; else its exit status.
pub fn child_error(stderr: &str, status: std::process::ExitStatus) -> String {
    let line = stderr
        .lines()
        .find_map(|l| l.strip_prefix("Error: "))
        .or_else(|| stderr.lines().rev().find(|l| !l.trim().is_empty()))
        .unwrap_or("")
        .trim();
    if line.is_empty() {
        format!("exited with {status}")
    } else {
        line.to_string()
    }
}

/// Makes the child get SIGKILL when the harness dies, however it dies (`kill -9` included), so a
/// child never runs on (or holds a GPU) without it. Linux's parent-death signal; elsewhere nothing.
pub fn die_with_parent(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let parent = std::process::id();
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have died before the call: then nobody would send the signal.
                if libc::getppid() as u32 != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}
