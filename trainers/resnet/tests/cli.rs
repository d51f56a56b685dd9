//! The `train-resnet` binary learns on its default data and rejects bad input clearly.

use std::process::Command;

fn run(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_train-resnet")).args(args).output().unwrap()
}

#[test]
fn loss_falls_on_synthetic_images() {
    // In f32, with bf16 and f16 activations (f16 under loss scaling) and with bf16 weights.
    for dtype in ["f32", "bf16", "f16", "bf16-weights"] {
        let args = ["--preset", "tiny", "--steps", "30", "--batch", "16", "--image-size", "32", "--classes", "4", "--dtype", dtype];
        let (losses, _) = trainkit::run_logged(env!("CARGO_BIN_EXE_train-resnet"), &args);
        let median = |v: &[f32]| {
            let mut v = v.to_vec();
            v.sort_by(f32::total_cmp);
            v[v.len() / 2]
        };
        // Medians, not means: at this learning rate single batches spike (a loss of 4 between
        // losses of 0.01), and a mean of five follows the spike, which the last rounding bit can
        // move.
        let (first, last) = (median(&losses[..5]), median(&losses[20..]));
        // Chance level for 4 classes is ln 4 = 1.39.
        assert!(last < 0.6 * first, "{dtype}: loss went {first:.3} -> {last:.3}");
    }
}

#[test]
fn bad_input_gives_clear_errors() {
    for (args, needle) in [
        (vec!["--preset", "resnet51"], "valid presets: tiny, resnet18"),
        (vec!["--preset", "tiny", "--policy", "every-other"], "valid policies"),
        (vec!["--preset", "tiny", "--image-size", "16"], "at least 32"),
        (vec!["--preset", "tiny", "--data", "/nonexistent/folder"], "image folder /nonexistent/folder"),
    ] {
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && !err.contains("panicked") && err.contains(needle), "{args:?}: {err}");
    }
}
