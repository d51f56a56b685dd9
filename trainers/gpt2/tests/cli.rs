//! The `train-gpt2` binary: it learns, and bad input gives a clear error, never a panic.

use std::path::PathBuf;
use std::process::{Command, Output};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_train-gpt2")).args(args).output().unwrap()
}

fn temp_file(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("train-gpt2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn assert_fails_with(args: &[&str], needle: &str) {
    let out = run(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} should fail");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(err.contains(needle), "{args:?}: expected `{needle}` in: {err}");
}

#[test]
fn bad_input_gives_clear_errors() {
    assert_fails_with(&["--preset", "huge"], "valid presets: tiny, small");
    assert_fails_with(&["--preset", "tiny", "--policy", "sqroot"], "valid policies: off, sqrt, every-two-blocks");
    assert_fails_with(&["--preset", "tiny", "--policy", "before-downsample", "--steps", "1"], "no downsampling stage");
    assert_fails_with(&["--preset", "tiny", "--seq", "300"], "context is 1..=256");
    assert_fails_with(&["--preset", "tiny", "--device", "tpu"], "valid devices: cpu, cuda, cuda:N");
    assert_fails_with(&["--preset", "tiny", "--device", "cuda:x"], "cuda:N needs a number");
    if !candle_core::utils::cuda_is_available() {
        assert_fails_with(&["--preset", "tiny", "--device", "cuda"], "this build has no CUDA support");
    }
    let empty = temp_file("empty.bin", b"");
    assert_fails_with(&["--preset", "tiny", "--data", empty.to_str().unwrap()], "is empty");
    let odd = temp_file("odd.bin", b"abc");
    assert_fails_with(&["--preset", "tiny", "--data", odd.to_str().unwrap()], "odd number");
    let big = temp_file("big.bin", &[0xff; 2000]);
    assert_fails_with(&["--preset", "tiny", "--seq", "16", "--data", big.to_str().unwrap()], "outside the vocabulary");
}

#[test]
fn loss_falls_over_fifty_steps_on_the_default_corpus() {
    let log = temp_file("log.jsonl", b"");
    let out = run(&[
        "--preset", "tiny", "--policy", "sqrt", "--steps", "50", "--batch", "8", "--seq", "64", "--lr", "3e-3",
        "--log-json", log.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let losses: Vec<f64> = trainkit::read_losses(&log).unwrap().into_iter().map(f64::from).collect();
    assert_eq!(losses.len(), 50);
    let last: f64 = losses[45..].iter().sum::<f64>() / 5.0;
    // Uniform over 256 byte tokens is ln 256 = 5.55; the corpus's grammar is learnable well below.
    assert!(losses[0] > 5.0 && last < losses[0] - 1.5, "loss went {} -> {last}", losses[0]);
}

#[test]
fn snapshots_are_written_during_the_run_and_load_back() {
    let snap = temp_file("snapshot.safetensors", b"");
    std::fs::remove_file(&snap).unwrap();
    let args = ["--preset", "tiny", "--steps", "3", "--batch", "2", "--seq", "16", "--save-every", "2", "--save", snap.to_str().unwrap()];
    let out = run(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::metadata(&snap).unwrap().len() > 0);
    let out = run(&["--preset", "tiny", "--steps", "1", "--seq", "16", "--init", snap.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_fails_with(&["--preset", "tiny", "--save-every", "2"], "--save");
}
