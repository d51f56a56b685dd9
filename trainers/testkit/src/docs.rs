//! The documentation's command lines: README.md and docs/ read as a user reads them, and every
//! documented command of a binary still parsing.

use std::path::Path;

/// README.md and every page of docs/, one after the other: the documentation a user reads.
pub fn docs_text() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut pages = vec![root.join("README.md")];
    if let Ok(entries) = std::fs::read_dir(root.join("docs")) {
        let mut docs: Vec<_> = entries
            .filter_map(|e| Some(e.ok()?.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "md"))
            .collect();
        docs.sort();
        pages.extend(docs);
    }
    pages
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The command lines of README.md and docs/ that run the binary `bin` (`cargo run ... --bin
/// train-gpt2 -- ARGS`, `cargo run ... -p bench-harness -- ARGS`, `target/release/train-gpt2 ARGS`;
/// lines ending in `\` joined, `# comments` dropped): each one's ARGS, for a test to check that
/// they still parse.
pub fn readme_commands(bin: &str) -> Vec<Vec<String>> {
    let joined = docs_text().replace("\\\n", " ");
    let starts = [format!("--bin {bin} -- "), format!("target/release/{bin} ")];
    let mut commands = Vec::new();
    for line in joined.lines() {
        let line = line.split(" # ").next().unwrap_or("").trim();
        let harness = bin == "bench-harness"
            && line.starts_with("cargo run")
            && line.contains("-p bench-harness");
        let args = match starts.iter().find_map(|s| line.split_once(s.as_str())) {
            Some((_, args)) => args,
            None if harness => line.split_once(" -- ").map_or("", |(_, args)| args),
            None => continue,
        };
        // Up to the end of the command: a pipe, a redirection or the next command.
        commands.push(
            args.split_whitespace()
                .take_while(|w| {
                    !["&&", "||", "|", ";"].contains(w)
                        && !w.starts_with('>')
                        && !w.starts_with("2>")
                })
                .map(str::to_string)
                .collect(),
        );
    }
    commands
}

/// Fails unless every documented command line of `bin` ([`readme_commands`]; at least `at_least` of
/// them) still parses: run with `--help` last, which the parser answers only once every flag
/// before it exists and its value reads.
pub fn assert_readme_commands_parse(bin: &str, path: &str, at_least: usize) {
    let commands = readme_commands(bin);
    assert!(
        commands.len() >= at_least,
        "README.md and docs/ have {} command lines of {bin}, expected {at_least} or more",
        commands.len()
    );
    for args in commands {
        let out = std::process::Command::new(path).args(&args).arg("--help").output().unwrap();
        assert!(
            out.status.success(),
            "documented command {bin} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
