//! The documented command lines for `train-gpt2` still parse: a renamed or removed flag fails here,
//! not in a reader's terminal.

#[test]
fn the_readme_commands_parse() {
    testkit::assert_readme_commands_parse("train-gpt2", env!("CARGO_BIN_EXE_train-gpt2"), 6);
}
