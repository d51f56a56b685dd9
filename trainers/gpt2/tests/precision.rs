//! Mixed precision through the trainer: bf16 and f16 activations, and bf16 weights, train (the
//! loss falls), f16's loss scaling skips the steps whose gradients overflow and recovers, and bad
//! `--dtype` and `--loss-scale` input is refused.

const BIN: &str = env!("CARGO_BIN_EXE_train-gpt2");

fn args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    [&["--preset", "tiny", "--seq", "32", "--steps", "30", "--lr", "1e-3"][..], extra].concat()
}

#[test]
fn half_precision_training_lowers_the_loss() {
    for dtype in ["bf16", "f16", "bf16-weights"] {
        let (losses, _) = testkit::run_logged(BIN, &args(&["--dtype", dtype]));
        testkit::assert_loss_falls(&losses, 0.5, dtype);
    }
}

/// A loss scale of 1e9 overflows f16's gradients: those steps are skipped and the scale halved
/// until it fits, then training goes on.
#[test]
fn f16_loss_scaling_skips_overflowing_steps_and_recovers() {
    let (losses, err) = testkit::run_logged(BIN, &args(&["--dtype", "f16", "--loss-scale", "1e9"]));
    let skipped: Vec<usize> = err
        .lines()
        .filter(|l| l.contains("update skipped"))
        .filter_map(|l| l.strip_prefix("step ")?.split(':').next()?.parse().ok())
        .collect();
    assert!(skipped.first() == Some(&0), "step 0 was not skipped: {err}");
    let recovered = skipped.last().unwrap() + 1;
    assert!(recovered + 10 <= losses.len(), "still skipping after step {recovered}: {err}");
    testkit::assert_loss_falls(&losses[recovered..], 0.3, "after the scale recovered");
}

#[test]
fn bad_precision_input_is_refused() {
    let fails = |extra: &[&str], needle: &str| {
        let out = std::process::Command::new(BIN).args(args(extra)).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(needle), "{extra:?}: {err}");
    };
    fails(&["--dtype", "f8"], "valid dtypes: f32, bf16, f16, bf16-weights");
    fails(&["--loss-scale", "1024"], "--loss-scale applies to --dtype f16 only");
    fails(&["--dtype", "f16", "--loss-scale", "0"], "is not a positive number f32 can hold");
    // Above f32's largest number every step would overflow and be skipped.
    fails(&["--dtype", "f16", "--loss-scale", "1e40"], "is not a positive number f32 can hold");
    // Below 1 the gradients underflow f16 further (at 1e-30 every one is zero).
    fails(&["--dtype", "f16", "--loss-scale", "1e-30"], "--loss-scale 1e-30 is below 1");
    fails(&["--dtype", "f16", "--loss-scale", "0.5"], "is below 1");
}
