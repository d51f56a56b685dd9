//! Data parallelism for the Llama family (`cargo test -p llama --features mpi --test mpi`; needs
//! Open MPI's `mpirun`): LoRA over a bf16 base with LoRA and attention dropout on, on two ranks,
//! ends under every policy with the adapters of `off`, bit for bit, and the ranks stay in sync.
#![cfg(feature = "mpi")]

#[test]
fn two_llama_ranks_checkpoint_bit_identically() {
    let args = ["--preset", "tiny", "--seq", "32", "--batch", "2", "--steps", "2"];
    let lora = ["--dtype", "bf16-weights", "--lora", "4", "--lora-dropout", "0.1"];
    testkit::cli::assert_two_ranks_checkpoint_as_off(
        env!("CARGO_BIN_EXE_train-llama"),
        &[&args[..], &lora[..]].concat(),
        &["off", "sqrt", "every-two-blocks"],
    );
}
