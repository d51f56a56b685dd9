//! An interrupted run resumed from its training snapshot (`--save-every`, `--resume`) gives the
//! losses and final weights of an uninterrupted one, bit for bit.

#[test]
fn a_resumed_run_is_bit_identical_to_an_uninterrupted_one() {
    testkit::assert_resume_is_bit_identical(
        env!("CARGO_BIN_EXE_train-gpt2"),
        &["--preset", "tiny", "--seq", "32"],
    );
}

/// Under f16 the loss scaler's state travels in the training snapshot: at this initial scale
/// steps 0 and 1 overflow and are skipped (the cut falls after them, the scale quartered), steps
/// 2 and 3 update; a resumed run that restarted at the initial scale would skip step 2 too.
#[test]
fn a_resumed_f16_run_keeps_its_loss_scale() {
    let args = [
        "--preset",
        "tiny",
        "--seq",
        "32",
        "--dtype",
        "f16",
        "--loss-scale",
        "3.9e6",
        "--accumulate",
        "2",
    ];
    testkit::assert_resume_is_bit_identical(env!("CARGO_BIN_EXE_train-gpt2"), &args);
}

/// Every optimizer under every dtype resumes bit for bit. The snapshot holds SGD's velocity in f32;
/// loaded back as bf16 under `--dtype bf16-weights`, it would stop the resume, as no in-place
/// update takes it ("sgd-v: no in-place update of BF16 from BF16").
#[test]
fn every_optimizer_resumes_bit_identically_under_every_dtype() {
    for optimizer in ["sgd", "adamw", "adafactor"] {
        for dtype in ["f32", "bf16", "f16", "bf16-weights"] {
            let mut args =
                vec!["--preset", "tiny", "--seq", "16", "--optimizer", optimizer, "--dtype", dtype];
            if dtype == "f16" {
                // A scale that keeps tiny's f16 gradients finite: every step updates.
                args.extend(["--loss-scale", "1024"]);
            }
            testkit::assert_resume_is_bit_identical(env!("CARGO_BIN_EXE_train-gpt2"), &args);
        }
    }
}
