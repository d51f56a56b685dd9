//! `train-bert` refuses options it would not use instead of ignoring them.

/// `--vocab` without `--data` used to print the synthetic corpus's vocabulary size and train a
/// random model without a word about the file it was given.
#[test]
fn a_vocabulary_without_text_is_refused() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_train-bert")).args(["--preset", "tiny", "--steps", "1", "--vocab", "vocab.txt"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--data"), "{err}");
}
