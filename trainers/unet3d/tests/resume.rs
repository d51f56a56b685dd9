//! An interrupted run resumed from its training snapshot (`--save-every`, `--resume`) gives the
//! losses and final weights of an uninterrupted one, bit for bit.

#[test]
fn a_resumed_run_is_bit_identical_to_an_uninterrupted_one() {
    testkit::assert_resume_is_bit_identical(
        env!("CARGO_BIN_EXE_train-unet3d"),
        &["--preset", "tiny", "--volume", "8"],
    );
}
