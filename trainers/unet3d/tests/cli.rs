//! The trainer's command line under bad input (each failed before: the test says how).

use std::process::Command;

fn fails_saying(args: &[&str], needle: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_train-unet3d")).args(["--preset", "tiny", "--volume", "8", "--steps", "1"]).args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !err.contains("panicked") && err.contains(needle), "{args:?}: {err}");
}

/// `--group-norm` with more groups than channels is refused (it was silently clamped, training
/// another model than the one asked for), and `--classes 0` names the flag (it failed deep inside
/// with `empty tensor for reduce`).
#[test]
fn impossible_groups_and_classes_are_refused() {
    fails_saying(&["--group-norm", "1000"], "GroupNorm groups do not divide");
    fails_saying(&["--classes", "0"], "--classes must be at least 2");
    // One class trained at loss 0.
    fails_saying(&["--classes", "1"], "--classes must be at least 2");
}
