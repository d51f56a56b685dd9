//! `results/CLAIMS.md` stays honest: every claim has a status; a confirmed or refuted one names the
//! command that tests it and files that exist; an open one says what is missing.

use std::path::Path;

#[test]
fn every_claim_has_a_status_a_command_and_evidence_that_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join("results/CLAIMS.md")).unwrap();
    let rows: Vec<Vec<&str>> = text.lines().filter(|l| l.starts_with("| C")).map(|l| l.trim_matches('|').split(" | ").map(str::trim).collect()).collect();
    assert_eq!(rows.len(), 15, "the article makes 15 claims");
    for row in rows {
        let [id, claim, status, command, evidence] = row[..] else { panic!("a claim row needs 5 cells: {row:?}") };
        assert!(!claim.is_empty() && !evidence.is_empty(), "{id}: claim and evidence must be written out");
        // Paths in backticks that name a file of the repository.
        let files: Vec<&str> = evidence.split('`').skip(1).step_by(2).filter(|s| s.contains('/') && s.rsplit('/').next().unwrap().contains('.')).collect();
        match status {
            "confirmed" | "refuted" => {
                assert!(command.starts_with("`cargo ") && command.ends_with('`'), "{id}: `{command}` is not a command");
                assert!(!files.is_empty(), "{id}: no evidence file");
                for f in files {
                    assert!(root.join(f).exists(), "{id}: evidence {f} does not exist");
                }
            }
            "open" => assert_eq!(command, "—", "{id}: an open claim has no command yet"),
            other => panic!("{id}: status `{other}` is not confirmed, refuted or open"),
        }
    }
}
