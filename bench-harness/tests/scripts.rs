//! The CUDA build script explains itself on a machine without CUDA (it builds nothing for
//! `--help`); the README's harness commands parse.

use std::path::Path;
use std::process::Command;

#[test]
fn build_cuda_help_works_without_cuda() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("bash")
        .arg(root.join("scripts/build-cuda.sh"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for needle in ["usage: scripts/build-cuda.sh", "CUDA_COMPUTE_CAP", "PyPI", "stubs"] {
        assert!(help.contains(needle), "--help lacks `{needle}`:\n{help}");
    }
}

/// The README's harness command lines still parse (a renamed flag fails here).
#[test]
fn the_readme_commands_parse() {
    testkit::assert_readme_commands_parse("bench-harness", env!("CARGO_BIN_EXE_bench-harness"), 5);
}
