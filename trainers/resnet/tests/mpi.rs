//! Data parallelism for a model with BatchNorm (`cargo test -p resnet --features mpi --test mpi`;
//! needs Open MPI's `mpirun`): on two ranks, every policy ends with the weights and running
//! statistics of `off`, bit for bit, and the ranks stay in sync. It covers data parallelism with
//! BatchNorm, which GPT-2's rank tests do not reach.
#![cfg(feature = "mpi")]

#[test]
fn two_resnet_ranks_checkpoint_bit_identically() {
    let args = ["--preset", "tiny", "--classes", "4", "--image-size", "32", "--batch", "2"];
    let off = testkit::cli::assert_two_ranks_checkpoint_as_off(
        env!("CARGO_BIN_EXE_train-resnet"),
        &[&args[..], &["--steps", "2"]].concat(),
        &["off", "sqrt", "before-downsample"],
    );
    assert!(
        off.keys().any(|n| n.ends_with("running_mean")),
        "the snapshot holds the BatchNorm statistics"
    );
}
