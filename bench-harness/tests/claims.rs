//! `results/CLAIMS.md` stays honest: every claim has a status; a confirmed or refuted one names the
//! command that tests it and files that exist; an open one says what is missing; and every figure
//! in it is what its results folder gives (the ledger is rendered from its template, each figure a
//! query of a results folder): a rerun that changes a figure, or a hand edit, fails here.

mod common;
use std::path::Path;

#[test]
fn every_claim_has_a_status_a_command_and_evidence_that_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join("results/CLAIMS.md")).unwrap();
    let rows: Vec<Vec<&str>> = text
        .lines()
        .filter(|l| l.starts_with("| C"))
        .map(|l| l.trim_matches('|').split(" | ").map(str::trim).collect())
        .collect();
    // The article's fifteen (`C1`..`C15`), and its questions asked again of today's models
    // (`C14+`: C14 of the Llama family).
    let article = rows.iter().filter(|r| r[0][1..].chars().all(|c| c.is_ascii_digit())).count();
    assert_eq!(article, 15, "the article makes 15 claims");
    for row in rows {
        let [id, claim, status, command, evidence] = row[..] else {
            panic!("a claim row needs 5 cells: {row:?}")
        };
        assert!(
            !claim.is_empty() && !evidence.is_empty(),
            "{id}: claim and evidence must be written out"
        );
        // Paths in backticks that name a file of the repository.
        let files: Vec<&str> = evidence
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|s| s.contains('/') && s.rsplit('/').next().unwrap().contains('.'))
            .collect();
        match status {
            "confirmed" | "refuted" => {
                assert!(
                    command.starts_with("`cargo ") && command.ends_with('`'),
                    "{id}: `{command}` is not a command"
                );
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

#[test]
fn every_figure_of_the_ledger_is_what_its_results_folder_gives() {
    let results = Path::new(env!("CARGO_MANIFEST_DIR")).join("../results");
    let out = common::harness(&["claims", "--check", "--dir", results.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_figure_the_results_do_not_give_is_refused_with_the_measures_there_are() {
    let dir = common::out_dir("claims-refused");
    std::fs::create_dir_all(&dir).unwrap();
    let results = Path::new(env!("CARGO_MANIFEST_DIR")).join("../results");
    std::os::unix::fs::symlink(results.join("cpu-cpu"), dir.join("cpu-cpu")).unwrap();
    std::fs::write(
        dir.join("CLAIMS.template.md"),
        "ResNet-50 saves {{cpu-cpu resnet50 sqrt memory-saved}}.\n",
    )
    .unwrap();
    let out = common::harness(&["claims", "--dir", dir.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("unknown measure `memory-saved`") && stderr.contains("activation/off"),
        "{stderr}"
    );
    std::fs::write(
        dir.join("CLAIMS.template.md"),
        "Compiled: {{cpu-cpu compiled smollm2-135m 1 speed}}.\n",
    )
    .unwrap();
    let out = common::harness(&["claims", "--dir", dir.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("unknown compiled measure `speed`") && stderr.contains("ours/compiled"),
        "{stderr}"
    );
    std::fs::write(
        dir.join("CLAIMS.template.md"),
        "ResNet-50 keeps {{cpu-cpu resnet50 sqrt activation/off}}x.\n",
    )
    .unwrap();
    let out = common::harness(&["claims", "--dir", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ledger = std::fs::read_to_string(dir.join("CLAIMS.md")).unwrap();
    assert!(
        ledger
            .lines()
            .nth(1)
            .is_some_and(|l| l.starts_with("ResNet-50 keeps 0.") && l.ends_with("x.")),
        "{ledger}"
    );
}

/// A check with nothing to check fails naming what is missing: a `--dir` that does not exist, or
/// a folder without the ledger's template (the README's alone would be checked). Unchecked, both
/// passed with exit 0.
#[test]
fn a_folder_without_the_ledger_template_is_refused() {
    let dir = common::out_dir("claims-nothing");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("README-results.template.md"), "Nothing.\n").unwrap();
    for folder in [dir.join("nosuch"), dir.clone()] {
        let out = common::harness(&["claims", "--check", "--dir", folder.to_str().unwrap()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains("CLAIMS.template.md does not exist"),
            "{}: {stderr}",
            folder.display()
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
