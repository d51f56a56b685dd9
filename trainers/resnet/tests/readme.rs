//! The documented command lines for `train-resnet` still parse: a renamed or removed flag fails
//! here, not in a reader's terminal.

#[test]
fn the_readme_commands_parse() {
    testkit::assert_readme_commands_parse("train-resnet", env!("CARGO_BIN_EXE_train-resnet"), 2);
}

/// The documentation's planner example: its command is refused with the message it quotes, and the
/// cap it says fits trains.
#[test]
fn the_readme_planner_example_holds() {
    let readme = testkit::docs_text().split_whitespace().collect::<Vec<_>>().join(" ");
    let (_, rest) = readme.split_once("(`train-resnet ").expect("the README's planner example");
    let (command, rest) = rest.split_once("`)").unwrap();
    let quoted = rest.trim_start().strip_prefix('"').unwrap().split(',').next().unwrap();
    let args: Vec<&str> = command.split_whitespace().collect();
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_train-resnet")).args(args).output().unwrap()
    };
    let out = run(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains(quoted),
        "README quotes \"{quoted}\"; the run said: {err}"
    );

    let (_, rest) = readme.split_once("with `--memory-cap ").expect("the README's cap that fits");
    let (cap, rest) = rest.split_once('`').unwrap();
    assert!(rest.starts_with(" the run above fits and trains"), "{rest}");
    let cap_at = args.iter().position(|&a| a == "--memory-cap").unwrap() + 1;
    let mut fitting = args.clone();
    fitting[cap_at] = cap;
    fitting.extend(["--steps", "2"]);
    let out = run(&fitting);
    assert!(out.status.success(), "{fitting:?}: {}", String::from_utf8_lossy(&out.stderr));
}
