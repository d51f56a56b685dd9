//! An interrupted run resumed from its training snapshot (`--save-every`, `--resume`) gives the
//! losses and final weights of an uninterrupted one, bit for bit.

#[test]
fn a_resumed_run_is_bit_identical_to_an_uninterrupted_one() {
    trainkit::assert_resume_is_bit_identical(env!("CARGO_BIN_EXE_train-gpt2"), &["--preset", "tiny", "--seq", "32"]);
}

/// Under f16 the loss scaler's state travels in the training snapshot: at this initial scale
/// steps 0 and 1 overflow and are skipped (the cut falls after them, the scale quartered), steps
/// 2 and 3 update; a resumed run that restarted at the initial scale would skip step 2 too.
#[test]
fn a_resumed_f16_run_keeps_its_loss_scale() {
    let args = ["--preset", "tiny", "--seq", "32", "--dtype", "f16", "--loss-scale", "3.9e6", "--accumulate", "2"];
    trainkit::assert_resume_is_bit_identical(env!("CARGO_BIN_EXE_train-gpt2"), &args);
}
