//! Records the candle version from Cargo.lock and the commit the harness is built from, so results
//! name the candle and the code that produced them.
use std::process::Command;

fn main() {
    let lock = std::fs::read_to_string("../Cargo.lock").unwrap_or_default();
    let version = lock
        .split("[[package]]")
        .find(|p| p.contains("name = \"candle-core\""))
        .and_then(|p| p.lines().find_map(|l| l.strip_prefix("version = ")))
        .map(|v| v.trim_matches('"').to_string())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=CANDLE_VERSION={version}");
    println!("cargo:rerun-if-changed=../Cargo.lock");
    println!("cargo:rustc-env=HARNESS_COMMIT={}", commit());
    // A commit, a checkout or an edit to the code rebuilds the harness and its commit with it.
    for path in [
        "../.git/HEAD",
        "../.git/index",
        "../.git/refs",
        "../crates",
        "../trainers",
        "../datasets",
        "../vendor",
        "../scripts",
        "src",
    ] {
        println!("cargo:rerun-if-changed={path}");
    }
}

/// The short commit, `-dirty` where tracked files other than results and documentation differ
/// from it; `unknown` outside a git checkout.
fn commit() -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg("..")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let Some(commit) = git(&["rev-parse", "--short", "HEAD"]).filter(|c| !c.is_empty()) else {
        return "unknown".into();
    };
    let changed = git(&[
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
        ".",
        ":(exclude)results",
        ":(exclude)docs",
        ":(exclude)*.md",
    ]);
    if changed.is_some_and(|s| !s.is_empty()) {
        format!("{commit}-dirty")
    } else {
        commit
    }
}
