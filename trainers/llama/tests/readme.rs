//! The documented command lines for `train-llama` still parse: a renamed or removed flag fails
//! here, not in a reader's terminal.

#[test]
fn the_readme_commands_parse() {
    testkit::assert_readme_commands_parse("train-llama", env!("CARGO_BIN_EXE_train-llama"), 3);
}
