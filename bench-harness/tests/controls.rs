//! The gradient check can fail: with recompute drawing fresh dropout keys (the hidden
//! `--no-rng-replay`) a recomputing policy must be recorded as differing from plain candle, and
//! the same configuration without the switch as identical. Without this negative control a check
//! that compared nothing would pass every other test.

mod common;
use common::{harness, out_dir, record, smoke};

#[test]
fn the_gradient_check_fails_when_recompute_draws_fresh_dropout_keys() {
    let dir = out_dir("controls");
    let run = |extra: &[&str]| {
        smoke(
            &dir,
            &[
                &["--matrix", "models", "--models", "gpt2-tiny", "--policies", "sqrt", "--force"],
                extra,
            ]
            .concat(),
        );
        record(&dir, "gpt2-tiny", "sqrt")
    };

    let broken = run(&["--no-rng-replay"]);
    assert_eq!(broken["status"], "ok", "{}", broken["error"]);
    assert_eq!(
        broken["grads_bit_identical"], false,
        "fresh dropout keys on recompute went unnoticed: {broken}"
    );
    assert!(broken["grads_differing"].as_u64().unwrap() > 0, "{broken}");
    assert!(broken["max_abs_diff"].as_f64().unwrap() > 0.0, "{broken}");

    let sound = run(&[]);
    assert_eq!(sound["status"], "ok", "{}", sound["error"]);
    assert_eq!(sound["grads_bit_identical"], true, "{sound}");
    assert_eq!(sound["grads_differing"], 0, "{sound}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_control_switch_is_hidden_from_help() {
    let help = String::from_utf8_lossy(&harness(&["--help"]).stdout).into_owned();
    assert!(help.contains("--policies") && !help.contains("rng"), "{help}");
}
