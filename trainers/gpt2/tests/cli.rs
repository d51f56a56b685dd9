//! The trainer's command line under bad input. The code is `trainkit`'s, shared by every trainer;
//! GPT-2's binary stands for all four. Each of these failed before (the test says how).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

fn train(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_train-gpt2")).args(["--preset", "tiny", "--seq", "16"]).args(args).output().unwrap()
}

fn fails_saying(args: &[&str], needle: &str) -> String {
    let out = train(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success() && !err.contains("panicked") && err.contains(needle), "{args:?}: {err}");
    err
}

/// A `--save` that cannot be written fails before the first step, and leaves no temporary file.
/// Before, it failed after the last step, and a directory target kept `*.safetensors.partial`.
#[test]
fn an_unwritable_save_path_fails_before_training() {
    let dir = std::env::temp_dir().join(format!("cli-save-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = fails_saying(&["--steps", "3", "--save", dir.to_str().unwrap()], "is a directory");
    assert!(!err.contains("step    0"), "it trained first: {err}");
    fails_saying(&["--steps", "3", "--save", dir.join("no/such/folder/w.safetensors").to_str().unwrap()], "cannot write there");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "a temporary was left behind");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A learning rate that is not a positive finite number, and a loss that stops being finite, end
/// the run with an error. Before, both ran to the end with exit 0.
#[test]
fn non_finite_learning_rates_and_losses_fail() {
    fails_saying(&["--lr", "nan"], "is not a positive finite number");
    fails_saying(&["--lr=-1"], "is not a positive finite number");
    fails_saying(&["--steps", "20", "--lr", "1e30"], "the loss is");
}

/// A reader that closes the pipe after one line (`2>&1 | head -1`) ends the trainer quietly:
/// exit 0, no panic. Before, it panicked with exit 101.
#[test]
fn a_closed_pipe_ends_the_run_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_train-gpt2"))
        .args(["--preset", "tiny", "--seq", "16", "--steps", "200"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stderr.take().unwrap()).read_line(&mut first).unwrap(); // the reader then goes away
    let status = child.wait().unwrap();
    assert!(status.success(), "{first}: exited with {status}");
}

/// A config.json whose values cannot describe a model names the field. Before, `vocab_size: 0`
/// was blamed on `--data` and `layer_norm_epsilon: -1` trained to the end.
#[test]
fn a_bad_config_names_its_field() {
    let dir = std::env::temp_dir().join(format!("cli-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (field, value) in [("vocab_size", "0"), ("layer_norm_epsilon", "-1")] {
        let mut config = serde_json::json!({"vocab_size": 256, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 2, "layer_norm_epsilon": 1e-5});
        config[field] = serde_json::from_str(value).unwrap();
        let path = dir.join(format!("{field}.json"));
        std::fs::write(&path, config.to_string()).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_train-gpt2")).args(["--config", path.to_str().unwrap(), "--steps", "1", "--seq", "16"]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(field) && !err.contains("--data"), "{field} = {value}: {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Sizes this machine cannot hold are refused before anything is allocated, naming the flags and
/// the bytes. Before, `--batch 18446744073709551615` panicked with `capacity overflow` and
/// `--batch 100000000000` aborted with `memory allocation of ... bytes failed`.
#[test]
fn impossible_sizes_name_the_flags() {
    for batch in ["18446744073709551615", "100000000000"] {
        fails_saying(&["--batch", batch, "--steps", "1"], "--batch x --seq: the logits alone needs");
    }
}

/// `--eval-every 2` over 5 steps evaluates after steps 1, 3 and the last, on held-out batches:
/// printed, and logged as lines of their own that leave the training losses readable.
#[test]
fn evaluation_runs_when_due_and_is_logged() {
    let log = std::env::temp_dir().join(format!("cli-eval-{}.jsonl", std::process::id()));
    let out = train(&["--steps", "5", "--eval-every", "2", "--log-json", log.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    for step in [1, 3, 4] {
        assert!(err.contains(&format!("eval after step {step}: loss")), "no evaluation after step {step}: {err}");
    }
    assert_eq!(trainkit::read_losses(&log).unwrap().len(), 5);
    let eval = trainkit::read_eval_losses(&log).unwrap();
    assert_eq!(eval.len(), 3);
    assert!(eval.iter().all(|l| l.is_finite() && *l > 0.0), "{eval:?}");
    std::fs::remove_file(&log).unwrap();
}

/// `--accumulate N` says the micro-batch and the effective batch; `--accumulate 0` is refused.
#[test]
fn accumulation_shows_the_effective_batch() {
    let out = train(&["--steps", "2", "--batch", "3", "--accumulate", "4"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("accumulating 4 micro-batches of 3 per optimizer step: effective batch 12"), "{err}");
    fails_saying(&["--accumulate", "0"], "--accumulate must be at least 1");
}

/// An unknown `--optimizer` lists the valid ones.
#[test]
fn an_unknown_optimizer_lists_the_valid_ones() {
    fails_saying(&["--optimizer", "lion"], "valid optimizers: sgd, adamw, adafactor");
}

/// `--shard-optimizer` (ZeRO stage 1) on one rank would shard nothing: refused before training.
#[test]
fn a_sharded_optimizer_needs_several_ranks() {
    fails_saying(&["--steps", "1", "--shard-optimizer"], "--shard-optimizer shares the optimizer state among data-parallel ranks");
}

/// `--ranks` in a build without MPI says which feature it needs, instead of starting mpirun on
/// processes that cannot join.
#[cfg(not(feature = "mpi"))]
#[test]
fn ranks_without_the_mpi_feature_name_it() {
    fails_saying(&["--steps", "1", "--ranks", "2"], "--features mpi");
}
