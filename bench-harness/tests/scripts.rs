//! The CUDA build script explains itself on a machine without CUDA (it builds nothing for `--help`).

use std::path::Path;
use std::process::Command;

#[test]
fn build_cuda_help_works_without_cuda() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("bash").arg(root.join("scripts/build-cuda.sh")).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for needle in ["usage: scripts/build-cuda.sh", "CUDA_COMPUTE_CAP", "PyPI", "stubs"] {
        assert!(help.contains(needle), "--help lacks `{needle}`:\n{help}");
    }
}
