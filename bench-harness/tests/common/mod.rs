//! Running the harness binary at the smoke profile into a fresh results folder, and reading what
//! it wrote. Each test file uses a part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn harness(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_bench-harness")).args(args).output().unwrap()
}

/// An empty folder of its own for each test (tests of one file run in parallel).
pub fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bench-harness-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The arguments of a run at the smoke profile, one timed step, into `dir`, then `args`.
pub fn smoke_args<'a>(dir: &'a Path, args: &[&'a str]) -> Vec<&'a str> {
    let mut all = vec!["--profile", "smoke", "--steps", "1", "--out", dir.to_str().unwrap()];
    all.extend_from_slice(args);
    all
}

/// Runs the harness at the smoke profile, one timed step, into `dir`; must succeed. Returns stderr.
pub fn smoke(dir: &Path, args: &[&str]) -> String {
    let all = smoke_args(dir, args);
    let out = harness(&all);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "bench-harness {all:?} failed:\n{stderr}");
    stderr
}

/// The arguments of `--matrix models` of `models` under `policies` with no timing rounds, then
/// `extra`: what most tests run [`smoke`] with.
pub fn models_args<'a>(models: &'a str, policies: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut all = vec!["--matrix", "models", "--models", models, "--policies", policies];
    all.extend_from_slice(&["--rounds", "0"]);
    all.extend_from_slice(extra);
    all
}

pub fn matrix(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("matrix.json")).unwrap()).unwrap()
}

pub fn records(dir: &Path) -> Vec<serde_json::Value> {
    matrix(dir)["records"].as_array().unwrap().clone()
}

/// The record of (model, policy), which must exist, without its timeline (short enough to print).
pub fn record(dir: &Path, model: &str, policy: &str) -> serde_json::Value {
    let mut r = records(dir)
        .into_iter()
        .find(|r| r["model"] == model && r["policy"] == policy)
        .unwrap_or_else(|| panic!("no record of {model} {policy}"));
    r.as_object_mut().unwrap().remove("timeline");
    r
}
