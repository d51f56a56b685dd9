//! The main job at the smoke profile, as CI runs it: all four models, every applicable policy,
//! every gradient check bit-identical, every output written and readable; and a configuration
//! forced to fail is recorded without stopping the matrix.

mod common;
use common::{harness, out_dir, records};

#[test]
fn smoke_matrix_checks_every_model_and_policy() {
    let dir = out_dir("smoke");
    let args =
        ["--matrix", "all", "--profile", "smoke", "--steps", "2", "--out", dir.to_str().unwrap()];
    let out = harness(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let recs = records(&dir);
    let has = |model: &str, policy: &str| {
        recs.iter().any(|r| r["model"] == model && r["policy"] == policy)
    };
    for model in ["resnet-tiny", "bert-tiny", "unet3d-tiny", "gpt2-tiny"] {
        for policy in ["off", "sqrt", "every-two-blocks"] {
            assert!(has(model, policy), "{model} {policy} missing");
        }
    }
    assert!(has("resnet-tiny", "before-downsample") && has("unet3d-tiny", "before-downsample"));
    assert!(!has("gpt2-tiny", "before-downsample"), "before-downsample does not apply to GPT-2");
    for depth in [2, 4, 8, 16] {
        assert!(has(&format!("depth-{depth}"), "sqrt"));
    }
    for r in &recs {
        let what = format!("{} {}", r["model"], r["policy"]);
        assert_eq!(r["status"], "ok", "{what}: {}", r["error"]);
        assert_eq!(r["grads_bit_identical"], true, "{what}: gradients differ from plain candle");
        assert_eq!(r["params_without_grad"], 0, "{what}");
        assert!(
            r["step_peak_bytes"].as_u64().unwrap() > 0
                && r["step_ms_median"].as_f64().unwrap() > 0.0,
            "{what}"
        );
        assert!(r["timeline"].as_array().is_some_and(|t| !t.is_empty()), "{what}: no timeline");
        // This run's time / off and the two interleaved rounds', each a positive ratio.
        if r["policy"] != "off" {
            let rounds = r["time_vs_off"]["rounds"]
                .as_array()
                .unwrap_or_else(|| panic!("{what}: no time / off rounds"));
            assert_eq!(rounds.len(), 3, "{what}");
            assert!(
                rounds.iter().all(|x| x.as_f64().is_some_and(|x| x > 0.0)),
                "{what}: {rounds:?}"
            );
        }
    }

    let csv = std::fs::read_to_string(dir.join("matrix.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    for col in [
        "model",
        "policy",
        "batch",
        "input",
        "dtype",
        "device",
        "threads",
        "model_state_bytes",
        "step_peak_bytes",
        "activation_peak_bytes",
        "rss_peak_delta_bytes",
        "step_ms_median",
        "step_ms_min",
        "step_ms_max",
        "grads_bit_identical",
        "max_abs_diff",
        "status",
    ] {
        assert!(header.contains(&col), "CSV lacks column {col}");
    }
    assert_eq!(lines.count(), recs.len());

    let table = std::fs::read_to_string(dir.join("TABLE.md")).unwrap();
    for needle in ["ResNet-50", "BERT-Large", "UNet3D", "9.8 GB", "Depth sweep", "| sqrt |"] {
        assert!(table.contains(needle), "TABLE.md lacks `{needle}`:\n{table}");
    }
    for plot in ["tradeoff", "timelines", "depth"] {
        for ext in ["png", "svg"] {
            let len =
                std::fs::metadata(dir.join(format!("{plot}.{ext}"))).map(|m| m.len()).unwrap_or(0);
            assert!(len > 1000, "{plot}.{ext} missing or empty");
        }
    }

    // A second run resumes: nothing is rerun.
    let again = harness(&args);
    assert!(again.status.success());
    assert!(
        !String::from_utf8_lossy(&again.stderr).contains("grads = plain candle"),
        "a finished configuration was rerun"
    );
    // A resume under another configuration is refused, naming what differs, rather than keeping
    // the old records as if they matched.
    for (flag, value, says) in
        [("--batch", "3", "batch 2 vs 3"), ("--steps", "1", "timed steps 2 vs 1")]
    {
        let mut args = args.to_vec();
        args.retain(|a| !(flag == "--steps" && (*a == "--steps" || *a == "2")));
        args.extend([flag, value]);
        let other = harness(&args);
        let err = String::from_utf8_lossy(&other.stderr);
        assert!(
            !other.status.success() && err.contains("another configuration") && err.contains(says),
            "{flag} {value}: {err}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_failing_configuration_is_recorded_and_the_matrix_goes_on() {
    let dir = out_dir("oom");
    let out = harness(&[
        "--matrix",
        "models",
        "--profile",
        "smoke",
        "--models",
        "gpt2-tiny,bert-tiny",
        "--policies",
        "off",
        "--memory-cap",
        "2MiB",
        "--out",
        dir.to_str().unwrap(),
    ]);
    // An `oom` is a result, but a run where every configuration ran out exits non-zero.
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("every configuration ran out of memory"),
        "{err}"
    );
    let recs = records(&dir);
    assert_eq!(recs.len(), 2, "both configurations are recorded");
    for r in recs {
        assert_eq!(r["status"], "oom", "{r}");
        // The refusal names the phase it happened in.
        let e = r["error"].as_str().unwrap();
        assert!(e.starts_with("heap cap: refused") && e.contains(" during "), "{r}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_arguments_name_the_valid_choices() {
    for (args, needle) in [
        (vec!["--profile", "huge"], "possible values: smoke, cpu, full, gpt2-24gb"),
        (vec!["--policies", "sqrtt"], "valid policies"),
        (vec!["--matrix", "some"], "possible values: all, models, depth, render, gpt2-24gb"),
        (vec!["--device", "tpu"], "valid devices: cpu, cuda"),
        (vec!["--profile", "smoke", "--models", "vgg"], "matches no model"),
        (vec!["--memory-cap", "12 parsecs"], "unknown unit"),
        (
            vec!["--profile", "smoke", "--shard-optimizer"],
            "--shard-optimizer shares the optimizer state among data-parallel ranks",
        ),
    ] {
        let out = harness(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && !err.contains("panicked") && err.contains(needle),
            "{args:?}: {err}"
        );
    }
}
