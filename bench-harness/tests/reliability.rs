//! The harness under hostile conditions: a memory cap that one policy fits and another does not,
//! a `kill -9` in the middle of a run, a run from another directory, inputs that select nothing.
//! Each test says what would go wrong without its safeguard.

mod common;
use common::{harness, models_args, out_dir, record, records, smoke_args};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A cap between `sqrt`'s peak and `off`'s: `sqrt` is recorded `ok` and `off` `oom` with the phase
/// named. A gradient check that ran an `off` step inside the same capped process would record a
/// fitting `sqrt` as `oom` too, and the record would say only "memory allocation of N bytes
/// failed".
#[test]
fn a_cap_that_sqrt_fits_records_sqrt_ok_and_names_where_off_ran_out() {
    let dir = out_dir("cap");
    let run = |extra: &[&str]| {
        harness(&smoke_args(
            &dir,
            &models_args("gpt2-tiny", "off,sqrt", &[&["--force"], extra].concat()),
        ))
    };
    assert!(run(&[]).status.success());
    let (off, sqrt) = (record(&dir, "gpt2-tiny", "off"), record(&dir, "gpt2-tiny", "sqrt"));
    let peak = |r: &serde_json::Value| r["step_peak_bytes"].as_u64().unwrap();
    assert!(
        peak(&off) > peak(&sqrt) * 5 / 4,
        "off {} B, sqrt {} B: too close for the test",
        peak(&off),
        peak(&sqrt)
    );
    // The heap when a step starts (runtime, model, optimizer state), plus most of the way from
    // sqrt's peak to off's.
    let base = sqrt["timeline_base_bytes"].as_u64().unwrap();
    let cap = base + peak(&sqrt) + (peak(&off) - peak(&sqrt)) * 3 / 5;
    let out = run(&["--memory-cap", &cap.to_string()]);
    assert!(
        out.status.success(),
        "one configuration fits, so the run succeeds: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (off, sqrt) = (record(&dir, "gpt2-tiny", "off"), record(&dir, "gpt2-tiny", "sqrt"));
    assert_eq!(sqrt["status"], "ok", "{sqrt}");
    assert_eq!(sqrt["grads_bit_identical"], true, "the check runs uncapped, after the measurement");
    assert_eq!(off["status"], "oom", "{off}");
    let e = off["error"].as_str().unwrap();
    assert!(
        e.starts_with("heap cap: refused")
            && (e.contains("during forward (stage") || e.contains("during backward (stage")),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The pids of the processes whose parent is `parent`, from /proc.
fn children(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return vec![] };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // Field 4 (after the parenthesised name) is the parent pid.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
                == Some(parent)
        })
        .collect()
}

fn alive(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // A zombie (state Z) has exited; its parent, gone, can no longer reap it.
    !stat.is_empty()
        && stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()) != Some("Z")
}

/// `kill -9` of the harness takes its running child with it. Otherwise the `run-one` child would
/// run on to completion (on a GPU it would hold the device).
#[test]
#[cfg(target_os = "linux")]
fn a_killed_harness_leaves_no_child() {
    let dir = out_dir("kill");
    // A configuration that runs for seconds: the smoke GPT-2 at a long sequence, many steps.
    let mut h = Command::new(env!("CARGO_BIN_EXE_bench-harness"))
        .args([
            "--matrix",
            "models",
            "--profile",
            "smoke",
            "--models",
            "gpt2-tiny",
            "--policies",
            "off",
            "--steps",
            "500",
            "--input-size",
            "256",
        ])
        .args(["--out", dir.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let child = loop {
        if let Some(&c) = children(h.id()).first() {
            break c;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "the harness started no child");
        std::thread::sleep(Duration::from_millis(50));
    };
    h.kill().unwrap(); // SIGKILL
    h.wait().unwrap();
    let start = Instant::now();
    while alive(child) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "child {child} outlived the killed harness"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The commit recorded is the project's, wherever the harness runs from. Read from the current
/// directory's repository, it would be a foreign commit, or none.
#[test]
fn the_recorded_commit_is_the_projects_from_any_directory() {
    let project = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let head = Command::new("git")
        .arg("-C")
        .arg(&project)
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .unwrap();
    if !head.status.success() {
        return; // not a git checkout (a source tarball): nothing to compare against
    }
    let head = String::from_utf8_lossy(&head.stdout).trim().to_string();
    let dir = out_dir("commit");
    let elsewhere = std::env::temp_dir();
    let out = Command::new(env!("CARGO_BIN_EXE_bench-harness"))
        .current_dir(&elsewhere)
        .args(smoke_args(
            &dir,
            &["--matrix", "models", "--models", "gpt2-tiny", "--policies", "off"],
        ))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let meta = common::matrix(&dir)["meta"]["git_commit"].as_str().unwrap().to_string();
    assert!(meta.starts_with(&head), "recorded {meta}, the project is at {head}");
    assert_eq!(records(&dir).len(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Inputs that cannot mean anything fail with a message and a non-zero exit. Unchecked, a cap of 0
/// or below would be accepted, a selection of nothing would write an empty matrix and exit 0, a
/// trailing comma in `--models` would select every model, and `--retime` of a folder with nothing
/// measured would write empty reports.
#[test]
fn caps_below_one_byte_and_empty_selections_fail() {
    let dir = out_dir("nothing");
    for (args, needle) in [
        (vec!["--memory-cap", "0"], "not a positive size"),
        (vec!["--memory-cap=-1GiB"], "not a positive size"),
        (
            vec!["--profile", "smoke", "--models", "gpt2", "--policies", "before-downsample"],
            "selects no configuration",
        ),
        (vec!["--profile", "smoke", "--models", "gpt2,", "--dry-run"], "an empty model name"),
        (vec!["--profile", "smoke", "--retime"], "no measured configuration"),
    ] {
        let mut args = args.clone();
        args.extend(["--out", dir.to_str().unwrap()]);
        let out = harness(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && !err.contains("panicked") && err.contains(needle),
            "{args:?}: {err}"
        );
    }
    assert!(!dir.join("matrix.json").exists(), "nothing ran, so nothing is written");
}

/// A `--batch` whose logits alone exceed the machine is recorded `skipped` by the trainers' own
/// check, before its model is built, as the docs say. Unchecked, the child built the model and
/// profiled the step for a minute and then ran out of memory.
#[test]
fn a_batch_the_machine_cannot_hold_is_skipped_before_it_is_built() {
    let dir = out_dir("huge-batch");
    common::smoke(&dir, &models_args("gpt2-tiny", "off", &["--batch", "100000000"]));
    let r = record(&dir, "gpt2-tiny", "off");
    assert!(
        r["status"] == "skipped"
            && r["error"]
                .as_str()
                .unwrap()
                .starts_with("predicted only: --batch x --input-size: the logits alone: "),
        "{r}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The files of `dir` (not its subfolders) with their bytes, by name; not the run's lock, which
/// names the process that held the folder last.
fn files(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file() && !p.ends_with(".lock"))
        .map(|p| {
            (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap())
        })
        .collect()
}

/// A disk that fills while a results folder is written (a file-size limit here, which fails a
/// write the same way: text files fit, a figure does not) is reported naming the file, and every
/// file keeps its previous contents, none left partial. Unchecked, the error read
/// `plotting: BackendError(DrawingError(ImageError(IoError(..))))`, naming no file, and a
/// truncated PNG replaced the last good one.
#[test]
#[cfg(target_os = "linux")]
fn a_full_disk_while_writing_results_names_the_file_and_keeps_the_last_one() {
    use std::os::unix::process::CommandExt;
    let dir = out_dir("full-disk");
    common::smoke(&dir, &models_args("gpt2-tiny", "off", &[]));
    let before = files(&dir);
    let largest_text = before.iter().filter(|(n, _)| !n.ends_with(".png")).map(|(_, b)| b.len());
    let limit = largest_text.max().unwrap() as u64 + 1;
    assert!(before.values().any(|b| b.len() as u64 > limit), "no figure is over {limit} bytes");
    let mut render = Command::new(env!("CARGO_BIN_EXE_bench-harness"));
    render.args(["--matrix", "render", "--out", dir.to_str().unwrap()]);
    // SAFETY: async-signal-safe calls between fork and exec.
    unsafe {
        render.pre_exec(move || {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let cap = libc::rlimit { rlim_cur: limit, rlim_max: limit };
            match libc::setrlimit(libc::RLIMIT_FSIZE, &cap) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
    let out = render.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains(&format!("writing {}/", dir.display()))
            && err.contains(".png")
            && err.contains("File too large"),
        "{err}"
    );
    let after = files(&dir);
    let changed: Vec<&String> = after.keys().filter(|n| before.get(*n) != after.get(*n)).collect();
    assert!(
        after == before,
        "a file changed or a temporary was left: {changed:?} of {:?}",
        after.keys()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// What the harness prints is its result: `selftest` onto a full device ends with exit 1 naming
/// the stream. Unchecked, the self-test's findings were lost and it exited 0.
#[test]
#[cfg(target_os = "linux")]
fn output_that_cannot_be_written_fails_the_selftest() {
    testkit::assert_fails_on_a_full_stdout(
        Command::new(env!("CARGO_BIN_EXE_bench-harness")).arg("selftest"),
    );
}

/// A model name `run-one` does not know is refused with the names it does know.
#[test]
fn an_unknown_model_lists_the_profiles_models() {
    let out = harness(&[
        "run-one",
        "--model",
        "resnet-50",
        "--policy",
        "off",
        "--profile",
        "smoke",
        "--dry-run",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("not in profile `smoke`")
            && err.contains("gpt2-tiny"),
        "{err}"
    );
}

/// A truncated matrix.json does not block a fresh run: `--force` sets it aside instead of failing
/// to read it.
#[test]
fn force_sets_an_unreadable_matrix_aside() {
    let dir = out_dir("truncated");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("matrix.json"), "{\"meta\": {\"machine\": \"x").unwrap();
    let args =
        smoke_args(&dir, &["--matrix", "models", "--models", "gpt2-tiny", "--policies", "off"]);
    let out = harness(&args);
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--force"),
        "without --force it says what to do"
    );
    let out = harness(&[&args[..], &["--force"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(dir.join("matrix.json.unreadable").exists());
    assert_eq!(records(&dir).len(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A results folder measured on another processor (a fresh clone's committed one) is not resumed
/// into: one table would mix two machines. Refused naming both, unless `--force`, which starts
/// afresh. Unchecked, the run measured only what the folder lacked and rendered the mixture.
#[test]
fn results_of_another_processor_are_not_resumed_into() {
    let dir = out_dir("other-cpu");
    let args = models_args("gpt2-tiny", "off", &[]);
    common::smoke(&dir, &args);
    let mut m = common::matrix(&dir);
    m["meta"]["machine"] = "Another CPU 9000 (2 CPUs visible, candle threads 2)".into();
    std::fs::write(dir.join("matrix.json"), m.to_string()).unwrap();
    let out = harness(&smoke_args(&dir, &args));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("Another CPU 9000") && err.contains("--force"),
        "{err}"
    );
    common::smoke(&dir, &[&args[..], &["--force"]].concat());
    let machine = common::matrix(&dir)["meta"]["machine"].as_str().unwrap().to_string();
    assert!(!machine.starts_with("Another CPU"), "--force kept the other machine's results");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A run says where it is on stderr where no progress bar is drawn (not a terminal): a line as
/// each configuration starts, and one per timing round. Unchecked, `--retime --rounds 2` over
/// five models printed nothing for 12 minutes, and the main job nothing while it profiled.
#[test]
fn a_run_says_where_it_is() {
    let dir = out_dir("progress");
    let args = ["--models", "gpt2-tiny", "--policies", "off,sqrt", "--rounds", "1"];
    let err = common::smoke(&dir, &args);
    let said = ["measuring gpt2-tiny off", "timing round 1/1: gpt2-tiny sqrt"];
    assert!(said.iter().all(|s| err.contains(s)), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A second run into a results folder another run holds is refused naming that process, and
/// writes nothing there; once the holder has ended, the folder is free. Unlocked, both runs
/// resumed from one half-written `matrix.json`, timed the same configurations at once and mixed
/// their results.
#[test]
#[cfg(target_os = "linux")]
fn a_second_run_into_a_held_folder_is_refused() {
    use std::os::unix::io::AsRawFd;
    let dir = out_dir("held");
    std::fs::create_dir_all(&dir).unwrap();
    // Held as a running harness holds it: an exclusive flock on `.lock`, which names the holder.
    let held = std::fs::File::create(dir.join(".lock")).unwrap();
    std::fs::write(dir.join(".lock"), "4242").unwrap();
    // SAFETY: `held` is open, so its descriptor is valid for the call.
    assert_eq!(unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    let args = smoke_args(&dir, &models_args("gpt2-tiny", "off", &[]));
    let out = harness(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("in use by another bench-harness run (process 4242)"),
        "{err}"
    );
    assert!(!dir.join("matrix.json").exists(), "the refused run wrote into the folder");
    drop(held);
    common::smoke(&dir, &models_args("gpt2-tiny", "off", &[]));
    assert!(dir.join("matrix.json").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--rounds` is bounded: `--rounds 2^64-1` timed forever.
#[test]
fn rounds_beyond_their_bound_are_refused() {
    let dir = out_dir("rounds");
    let out = harness(&smoke_args(&dir, &["--rounds", "18446744073709551615"]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--rounds 18446744073709551615 is more than 1000"),
        "{err}"
    );
    let out = harness(&smoke_args(&dir, &["--accumulate", "18446744073709551615"]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("is more than 1000000"), "{err}");
}

/// `--python` names the Python of `--baseline pytorch`: without `--baseline` it is refused,
/// before anything runs. Unchecked, it was ignored and the run measured ours alone, as if no
/// Python had been named.
#[test]
fn python_without_a_baseline_is_refused() {
    let dir = out_dir("python-alone");
    let extra = ["--python", "/opt/venv/bin/python", "--dry-run"];
    let out = harness(&smoke_args(&dir, &models_args("gpt2-tiny", "off", &extra)));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && !err.contains("panicked")
            && err.contains("--python needs --baseline"),
        "{err}"
    );
    assert!(!dir.exists(), "the refused run wrote into the folder");
}

/// A matrix.json with two records of one configuration (model, policy), a hand merge of two
/// folders, is refused naming the file and the configuration, and nothing is written. Unchecked,
/// `--matrix render` printed both as rows of one table, and a resume replaced only the first.
#[test]
fn two_records_of_one_configuration_are_refused() {
    let dir = out_dir("duplicate");
    common::smoke(&dir, &models_args("gpt2-tiny", "off", &[]));
    let mut m = common::matrix(&dir);
    let records = m["records"].as_array_mut().unwrap();
    records.push(records[0].clone());
    std::fs::write(dir.join("matrix.json"), m.to_string()).unwrap();
    let before = files(&dir);
    let out = harness(&["--matrix", "render", "--out", dir.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && !err.contains("panicked")
            && err.contains(&dir.join("matrix.json").display().to_string())
            && err.contains("two records of gpt2-tiny off"),
        "{err}"
    );
    assert!(files(&dir) == before, "the refused render wrote into the folder");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--ranks 2` where mpirun is not installed (here: not on an empty PATH) is refused before
/// anything runs, naming mpirun and the package that has it. Unchecked, every configuration was
/// recorded as "could not start: No such file or directory (os error 2)", naming no program.
#[test]
fn ranks_without_mpirun_name_it_and_how_to_get_it() {
    let dir = out_dir("no-mpirun");
    let empty_path = out_dir("no-mpirun-path");
    std::fs::create_dir_all(&empty_path).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_bench-harness"))
        .env("PATH", &empty_path)
        .args(smoke_args(&dir, &models_args("gpt2-tiny", "off", &["--ranks", "2"])))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && !err.contains("panicked")
            && err.contains("mpirun")
            && err.contains("apt-get install openmpi-bin"),
        "{err}"
    );
    assert!(!dir.join("matrix.json").exists(), "nothing ran, so nothing is written");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::remove_dir_all(&empty_path).unwrap();
}

/// `--matrix depth` sweeps GPT-2 block stacks only: a `--models` of another model is refused
/// saying which models the depth matrix takes, and a profile without a depth sweep says so.
/// Unchecked, `--matrix depth --models resnet` said resnet was not in the profile, which has it.
#[test]
fn the_depth_matrix_names_the_models_it_takes() {
    let dir = out_dir("depth-models");
    for (args, needles) in [
        (
            vec!["--profile", "smoke", "--matrix", "depth", "--models", "resnet"],
            &["--matrix depth", "GPT-2", "depth-2, depth-4, depth-8, depth-16"][..],
        ),
        (
            vec!["--profile", "gpt2-24gb", "--matrix", "depth"],
            &["profile `gpt2-24gb` has no depth sweep"][..],
        ),
    ] {
        let mut args = args.clone();
        args.extend(["--dry-run", "--out", dir.to_str().unwrap()]);
        let out = harness(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && !err.contains("panicked")
                && !err.contains("matches no model of profile")
                && needles.iter().all(|n| err.contains(n)),
            "{args:?}: {err}"
        );
    }
    // The models matrix still names the profile's models.
    let out = harness(&["--profile", "smoke", "--models", "vgg", "--dry-run"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("gpt2-tiny"), "{err}");
}
