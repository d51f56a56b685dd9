//! The `train-unet3d` binary learns on its default data and rejects bad input clearly.

use std::process::Command;

fn run(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_train-unet3d")).args(args).output().unwrap()
}

#[test]
fn loss_falls_on_synthetic_volumes() {
    let log = std::env::temp_dir().join(format!("train-unet3d-{}.jsonl", std::process::id()));
    let out = run(&["--preset", "tiny", "--volume", "16", "--steps", "30", "--lr", "3e-3", "--log-json", log.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let losses: Vec<f64> = trainkit::read_losses(&log).unwrap().into_iter().map(f64::from).collect();
    let (first, last) = (losses[..3].iter().sum::<f64>() / 3.0, losses[27..].iter().sum::<f64>() / 3.0);
    assert!(last < 0.6 * first, "loss went {first:.3} -> {last:.3}");
}

#[test]
fn bad_input_gives_clear_errors() {
    for (args, needle) in [
        (vec!["--preset", "huge"], "valid presets: tiny, small"),
        (vec!["--preset", "tiny", "--volume", "10"], "multiple of 4"),
        (vec!["--preset", "tiny", "--policy", "downsample"], "valid policies"),
        (vec!["--preset", "tiny", "--data", "/nonexistent"], "volume folder /nonexistent"),
        (vec!["--preset", "tiny", "--volume", "8", "--classes", "2", "--steps", "1"], "outside --classes 2"),
    ] {
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && !err.contains("panicked") && err.contains(needle), "{args:?}: {err}");
    }
}
