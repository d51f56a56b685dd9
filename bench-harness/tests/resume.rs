//! Resuming and rendering: a second run without `--force` reruns nothing and leaves matrix.json as
//! it was, `--force` reruns; `--matrix render` rewrites every derived file from matrix.json alone
//! and says clearly when there is none.

mod common;
use common::{harness, matrix, out_dir, smoke};

/// Whether the harness measured a gpt2-tiny configuration: it prints one summary line for each.
fn ran(stderr: &str) -> bool {
    stderr.lines().any(|l| l.starts_with("gpt2-tiny "))
}

#[test]
fn a_second_run_reruns_nothing_and_force_reruns() {
    let dir = out_dir("resume");
    let args = ["--matrix", "models", "--models", "gpt2-tiny", "--policies", "off"];
    assert!(ran(&smoke(&dir, &args)));
    let first = matrix(&dir);

    let resumed = smoke(&dir, &args);
    assert!(!ran(&resumed), "a finished configuration was rerun:\n{resumed}");
    assert_eq!(matrix(&dir), first, "a resume that runs nothing must leave matrix.json as it was");

    // A time no measurement gives marks the old record: comparing two measured times would
    // fail whenever a rerun happened to take as long.
    let mut marked = first.clone();
    marked["records"][0]["step_ms_median"] = serde_json::json!(-1.0);
    std::fs::write(dir.join("matrix.json"), serde_json::to_string(&marked).unwrap()).unwrap();
    let forced = smoke(&dir, &[&args[..], &["--force"]].concat());
    assert!(ran(&forced), "--force reran nothing:\n{forced}");
    assert!(
        matrix(&dir)["records"][0]["step_ms_median"].as_f64().unwrap() > 0.0,
        "--force kept the old record"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn render_rewrites_every_derived_file_from_matrix_json() {
    let dir = out_dir("render");
    // A depth-sweep model too, so that the depth plot is drawn.
    smoke(&dir, &["--matrix", "all", "--models", "gpt2-tiny,depth-2", "--policies", "off"]);
    let files = [
        "matrix.csv",
        "matrix.md",
        "TABLE.md",
        "tradeoff.png",
        "tradeoff.svg",
        "timelines.png",
        "timelines.svg",
        "depth.png",
        "depth.svg",
    ];
    let written: Vec<Vec<u8>> = files
        .iter()
        .map(|f| std::fs::read(dir.join(f)).unwrap_or_else(|e| panic!("{f}: {e}")))
        .collect();
    for f in files {
        std::fs::remove_file(dir.join(f)).unwrap();
    }

    let out =
        harness(&["--matrix", "render", "--profile", "smoke", "--out", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for (f, before) in files.iter().zip(&written) {
        let after = std::fs::read(dir.join(f)).unwrap_or_else(|e| panic!("{f} not rendered: {e}"));
        assert!(!after.is_empty() && &after == before, "{f} not rendered as the run wrote it");
    }
    std::fs::remove_dir_all(&dir).unwrap();

    let empty = out_dir("render-empty");
    let out =
        harness(&["--matrix", "render", "--profile", "smoke", "--out", empty.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && !err.contains("panicked")
            && err.contains("no matrix.json to render"),
        "{err}"
    );
    assert!(!empty.exists(), "render without matrix.json must write nothing");
}

#[test]
fn retime_replaces_the_times_and_nothing_else() {
    let dir = out_dir("retime");
    let args = ["--matrix", "models", "--models", "gpt2-tiny", "--policies", "off,sqrt"];
    smoke(&dir, &[&args[..], &["--rounds", "0"]].concat());
    // Times no measurement gives mark the measuring run's: each must be replaced by the rounds'.
    let mut marked = matrix(&dir);
    for r in marked["records"].as_array_mut().unwrap() {
        r["step_ms_median"] = serde_json::json!(-1.0);
    }
    std::fs::write(dir.join("matrix.json"), serde_json::to_string(&marked).unwrap()).unwrap();

    let out = smoke(&dir, &[&args[..], &["--retime", "--rounds", "2"]].concat());
    assert!(!ran(&out), "--retime measured a configuration again:\n{out}");
    let after = matrix(&dir);
    for (before, r) in
        marked["records"].as_array().unwrap().iter().zip(after["records"].as_array().unwrap())
    {
        let ms = r["step_ms_median"].as_f64().unwrap();
        assert!(
            ms > 0.0
                && r["step_ms_min"].as_f64().unwrap() <= ms
                && ms <= r["step_ms_max"].as_f64().unwrap(),
            "{r}"
        );
        assert!(
            r["times_command"].as_str().unwrap().contains("--retime"),
            "the record does not name what timed it: {r}"
        );
        for memory in [
            "step_peak_bytes",
            "activation_peak_bytes",
            "predicted_peak_bytes",
            "command",
            "commit",
        ] {
            assert_eq!(r[memory], before[memory], "--retime changed {memory}");
        }
    }
    let sqrt = &after["records"][1];
    assert_eq!(sqrt["policy"], "sqrt");
    // The two rounds alone: the measuring run's ratio (against a marked time) is left out.
    let rounds = sqrt["time_vs_off"]["rounds"].as_array().unwrap();
    assert!(
        rounds.len() == 2 && rounds.iter().all(|r| r.as_f64().unwrap() > 0.0),
        "{}",
        sqrt["time_vs_off"]
    );
    assert!(
        std::fs::read_to_string(dir.join("matrix.md")).unwrap().contains("--retime"),
        "the report does not name the retiming command"
    );

    // A model whose `off` did not fit keeps no ratio, but its other policies' times are taken
    // again.
    let mut no_off = after.clone();
    no_off["records"][0]["status"] = serde_json::json!("skipped");
    no_off["records"][1]["step_ms_median"] = serde_json::json!(-1.0);
    std::fs::write(dir.join("matrix.json"), serde_json::to_string(&no_off).unwrap()).unwrap();
    smoke(&dir, &[&args[..], &["--retime", "--rounds", "1"]].concat());
    let sqrt = &matrix(&dir)["records"][1];
    assert!(
        sqrt["step_ms_median"].as_f64().unwrap() > 0.0,
        "the times of a model without `off` were not taken again: {sqrt}"
    );
    assert!(sqrt["time_vs_off"].is_null(), "a ratio against an `off` that did not run: {sqrt}");

    let refused = harness(&[
        "--profile",
        "smoke",
        "--out",
        dir.to_str().unwrap(),
        "--matrix",
        "models",
        "--models",
        "gpt2-tiny",
        "--policies",
        "sqrt",
        "--retime",
    ]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("keep `off` among --policies"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A run killed during a model's timing rounds (they are stored after the last) is finished by
/// the same command: the rounds are taken, nothing is measured again. Unchecked, the resumed run
/// found every configuration measured, took no rounds, and the `time / off` column stayed `-`.
#[test]
fn a_run_interrupted_in_its_timing_rounds_finishes_them() {
    use std::io::{BufRead, BufReader};
    let dir = out_dir("interrupted-rounds");
    let args = ["--matrix", "models", "--models", "gpt2-tiny", "--policies", "off,sqrt"];
    let rounds = ["--rounds", "2"];
    let mut h = std::process::Command::new(env!("CARGO_BIN_EXE_bench-harness"))
        .args(["--profile", "smoke", "--steps", "1", "--out", dir.to_str().unwrap()])
        .args(args)
        .args(rounds)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let said: Vec<String> = BufReader::new(h.stderr.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .take_while(|l| !l.starts_with("timing round 1/2"))
        .collect();
    h.kill().unwrap(); // SIGKILL, in the first round
    h.wait().unwrap();
    let sqrt = |dir: &std::path::Path| common::record(dir, "gpt2-tiny", "sqrt");
    assert!(sqrt(&dir)["time_vs_off"].is_null(), "killed after its rounds: {said:?}");

    let out = smoke(&dir, &[&args[..], &rounds].concat());
    assert!(!ran(&out), "the resumed run measured a configuration again:\n{out}");
    let ratios = sqrt(&dir)["time_vs_off"]["rounds"].as_array().cloned().unwrap_or_default();
    // The measuring run's ratio and the two rounds'.
    assert_eq!(ratios.len(), 3, "the resumed run did not finish the rounds:\n{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}
