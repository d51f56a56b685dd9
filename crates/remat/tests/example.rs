//! The crate's example runs in the test suite: an unmodified `candle_nn` stack checkpointed through
//! `remat::module`, gradients bit-identical to plain candle, a lower peak under `sqrt`.

#[path = "../examples/checkpoint_mlp.rs"]
mod example;

#[test]
fn an_ordinary_candle_model_checkpoints_in_one_line() {
    example::main().unwrap();
}
