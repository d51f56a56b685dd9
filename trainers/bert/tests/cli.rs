//! `train-bert` refuses options it would not use instead of ignoring them.

fn fails_saying(args: &[&str], needle: &str) {
    let out =
        std::process::Command::new(env!("CARGO_BIN_EXE_train-bert")).args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && !err.contains("panicked") && err.contains(needle),
        "{args:?}: {err}"
    );
}

/// Options that would go unused are refused. Unchecked, `--vocab` without text data would print the
/// synthetic corpus's vocabulary size and train a random model without a word about the file it
/// was given; each of the others would be as silent.
#[test]
fn options_that_would_go_unused_are_refused() {
    let tiny = ["--preset", "tiny", "--steps", "1"];
    for (extra, needle) in [
        (&["--vocab", "vocab.txt"][..], "--text"),
        (&["--tokenizer", "tokenizer.json"], "--text"),
        (&["--hub-cache", "/tmp"], "--model-id"),
        (&["--offline"], "--model-id"),
        (&["--strict"], "none were given (--init or --model-id)"),
        (&["--eval-batches", "4"], "--eval-every"),
        (&["--config", "config.json"], "cannot be used with"),
        (&["--text", "a.txt", "--vocab", "v.txt", "--tokenizer", "t.json"], "cannot be used with"),
    ] {
        fails_saying(&[&tiny[..], extra].concat(), needle);
    }
    fails_saying(
        &["--model-id", "someone/x", "--init", "w.safetensors", "--offline"],
        "cannot be used with",
    );
}
