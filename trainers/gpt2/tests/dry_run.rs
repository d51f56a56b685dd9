//! `--dry-run` predicts without training, from a profile that runs one stage at a time: the heap
//! it uses is well below what a step needs; and `--policy budget=` below the least any plan
//! reaches is refused with that minimum.

const BIN: &str = env!("CARGO_BIN_EXE_train-gpt2");

fn run(extra: &[&str]) -> std::process::Output {
    std::process::Command::new(BIN)
        .args([&["--preset", "tiny", "--seq", "64", "--batch", "32"][..], extra].concat())
        .output()
        .unwrap()
}

/// The MiB figure after `marker` in `text`.
fn mib_after(text: &str, marker: &str) -> f64 {
    let rest = &text
        [text.find(marker).unwrap_or_else(|| panic!("no `{marker}` in:\n{text}")) + marker.len()..];
    rest.trim_start().split(' ').next().unwrap().parse().unwrap()
}

#[test]
fn a_dry_run_predicts_every_phase_and_allocates_no_step() {
    let out = run(&["--dry-run", "--policy", "sqrt"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    for phase in ["forward", "backward", "recompute", "memory before a step"] {
        assert!(text.contains(phase), "no {phase} in:\n{text}");
    }
    let off_step = mib_after(&text, "off: total");
    let used = mib_after(&text, "profiling used");
    // The profile holds one stage at a time; a step under `off` holds all four blocks' outputs
    // for backward (each block's are the most any stage keeps), and then one block's backward
    // on top. So the profile needs about one block's keeps and one backward's temporaries, a
    // step four blocks' and one backward's: under half, whatever the machine.
    assert!(used < 0.5 * off_step, "the dry run used {used} MiB, a step needs {off_step} MiB");
    assert!(
        !text.contains("step    0") && !String::from_utf8_lossy(&out.stderr).contains("step    0"),
        "a dry run trains nothing"
    );
}

#[test]
fn a_budget_below_the_minimum_names_it() {
    let out = run(&["--policy", "budget=1MiB", "--steps", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("below the smallest peak any checkpoint plan reaches"),
        "{err}"
    );
}

#[test]
fn a_budget_plan_trains() {
    let out = run(&["--policy", "budget=40MiB", "--steps", "2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("budget=40MiB: plan="), "{err}");
}

/// `auto` plans for `--memory-cap`: a cap nothing fits is refused, one that fits trains under it.
#[test]
fn auto_plans_for_the_memory_cap() {
    let out = run(&["--policy", "auto", "--memory-cap", "1MiB", "--steps", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("auto: budget 1.0 MiB is below the smallest peak"),
        "{err}"
    );
    let out = run(&["--policy", "auto", "--memory-cap", "200MiB", "--steps", "2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("auto: plan="), "{err}");
}
