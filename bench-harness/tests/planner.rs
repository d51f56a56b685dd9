//! The planner against the meter: its predicted step peak equals the measured one for tiny models
//! of all five kinds under every policy; a `budget=` plan fits its budget when it runs; a budget
//! below the least any plan reaches is refused with that minimum; the `off` record carries the
//! memory/time frontier.

mod common;
use common::{harness, models_args, out_dir, records, smoke, smoke_args};

/// Relative error the tests allow between predicted and measured step peaks. Measured: under
/// 1% for every smoke configuration at batch 8 (the largest was ResNet's -0.8%).
const TOLERANCE: f64 = 0.03;

#[test]
fn predictions_match_the_meter_for_tiny_models_of_every_kind() {
    let dir = out_dir("planner-predict");
    smoke(&dir, &["--matrix", "models", "--batch", "8", "--rounds", "0"]);
    let recs = records(&dir);
    assert_eq!(recs.len(), 17, "every model and policy of the smoke profile");
    for r in &recs {
        let what = format!("{} {}", r["model"], r["policy"]);
        let (measured, predicted) = (
            r["step_peak_bytes"].as_f64().unwrap(),
            r["predicted_peak_bytes"].as_f64().unwrap_or(0.0),
        );
        let error = predicted / measured - 1.0;
        assert!(
            error.abs() <= TOLERANCE,
            "{what}: predicted {predicted}, measured {measured} ({:+.1}%)",
            error * 100.0
        );
        let ratio = r["predicted_time_ratio"].as_f64().unwrap();
        assert!(
            if r["policy"] == "off" { ratio == 1.0 } else { ratio > 1.0 },
            "{what}: predicted time ratio {ratio}"
        );
    }
    let off = recs.iter().find(|r| r["model"] == "gpt2-tiny" && r["policy"] == "off").unwrap();
    let frontier = off["frontier"].as_array().expect("off carries the frontier");
    assert!(frontier.len() >= 2, "{frontier:?}");
    let peaks: Vec<u64> = frontier.iter().map(|p| p["peak_bytes"].as_u64().unwrap()).collect();
    assert!(
        peaks.windows(2).all(|w| w[0] <= w[1]),
        "the frontier runs from the least peak up: {peaks:?}"
    );
}

/// Selective recompute (`+keep=`): predicted as measured, gradients = plain candle's, the kept
/// outputs cost no less memory than the same cut without them (GPT-2 tiny's peak rises by them;
/// ResNet tiny's falls in its first segment's recompute, where they give way to their copies),
/// and the replayed ops save time: the predicted time ratio lies between 1 and the plain cut's.
#[test]
fn predictions_match_the_meter_under_selective_recompute() {
    let dir = out_dir("planner-keep");
    let policies = "sqrt,sqrt+keep=matmul+attention,sqrt+keep=conv";
    smoke(&dir, &models_args("gpt2,resnet", policies, &["--batch", "8"]));
    let recs = records(&dir);
    assert_eq!(
        recs.len(),
        4,
        "sqrt and its keep= variant for each model (conv alone applies to \
        ResNet, matmul+attention to GPT-2)"
    );
    for keeping in recs.iter().filter(|r| r["policy"].as_str().unwrap().contains("+keep=")) {
        let what = format!("{} {}", keeping["model"], keeping["policy"]);
        let sqrt =
            recs.iter().find(|r| r["model"] == keeping["model"] && r["policy"] == "sqrt").unwrap();
        assert_eq!(keeping["grads_bit_identical"], true, "{what}");
        let (measured, predicted) = (
            keeping["step_peak_bytes"].as_f64().unwrap(),
            keeping["predicted_peak_bytes"].as_f64().unwrap(),
        );
        let error = predicted / measured - 1.0;
        assert!(
            error.abs() <= TOLERANCE,
            "{what}: predicted {predicted}, measured {measured} ({:+.1}%)",
            error * 100.0
        );
        assert!(
            keeping["activation_peak_bytes"].as_u64() >= sqrt["activation_peak_bytes"].as_u64(),
            "{what}: holds less than sqrt"
        );
        let (ratio, plain) = (
            keeping["predicted_time_ratio"].as_f64().unwrap(),
            sqrt["predicted_time_ratio"].as_f64().unwrap(),
        );
        assert!(
            1.0 < ratio && ratio < plain,
            "{what}: predicted time ratio {ratio}, sqrt's {plain}"
        );
    }
}

#[test]
fn a_budget_plan_fits_its_budget_and_one_below_the_minimum_is_refused() {
    let dir = out_dir("planner-budget");
    smoke(&dir, &models_args("gpt2", "off", &["--batch", "8"]));
    let off = &records(&dir)[0];
    let off_total =
        off["model_state_bytes"].as_u64().unwrap() + off["step_peak_bytes"].as_u64().unwrap();
    // Between the least peak and off's: the planner must cut, and the cut must fit. A whole
    // number of KiB, so that the record's spelling differs from the one asked for every time.
    let budget = off_total * 9 / 10 / 1024 * 1024;
    let policy = format!("budget={budget}");
    smoke(&dir, &models_args("gpt2", &policy, &["--batch", "8"]));
    // By what the policy means, not its spelling: the record writes a byte count that is a
    // multiple of 1024 in KiB (`budget=11088KiB` for 11354112), so a string match failed on
    // some machines' figures and not others'.
    let meant = remat::PolicyRequest::Budget(budget);
    let r = records(&dir)
        .into_iter()
        .find(|r| r["policy"].as_str().and_then(|p| p.parse().ok()) == Some(meant.clone()));
    let r = r.unwrap_or_else(|| panic!("no record of {meant} (asked as {policy})"));
    assert_eq!(r["status"], "ok", "{}", r["error"]);
    assert!(r["plan"].as_str().unwrap().starts_with("plan="), "{}", r["plan"]);
    assert_eq!(r["grads_bit_identical"], true);
    let total = r["model_state_bytes"].as_u64().unwrap() + r["step_peak_bytes"].as_u64().unwrap();
    assert!(total <= budget, "measured {total} bytes under budget {budget}");

    let refused = out_dir("planner-refused");
    let out = harness(&smoke_args(&refused, &models_args("gpt2", "budget=1KiB", &[])));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("below the smallest peak any checkpoint plan reaches")
            && err.contains("the state before the step"),
        "{err}"
    );
    // Said once (an error that is also its own cause would print twice), in a unit that shows
    // the budget (in MiB it would read "budget 0.0 MiB").
    assert_eq!(err.matches("below the smallest peak").count(), 1, "{err}");
    assert!(err.contains("budget 1.0 KiB is below"), "{err}");
}

/// The depth sweep's `sqrt` rows, where the parameter gradients of many narrow blocks are held
/// through the first segments' backward: within 5 % of the meter. Leaving out every gradient
/// tensor's record (about 270 bytes on the heap beside its elements) would predict `sqrt` at depth
/// 16 10.2 % low (under-prediction is the unsafe direction for a budget).
#[test]
fn deep_sqrt_predictions_count_the_gradients_records() {
    let dir = out_dir("planner-depth");
    smoke(&dir, &["--matrix", "depth", "--models", "depth-8,depth-16", "--rounds", "0"]);
    for r in records(&dir) {
        let what = format!("{} {}", r["model"], r["policy"]);
        let (measured, predicted) =
            (r["step_peak_bytes"].as_f64().unwrap(), r["predicted_peak_bytes"].as_f64().unwrap());
        let error = predicted / measured - 1.0;
        eprintln!("{what}: predicted {predicted}, measured {measured} ({:+.1}%)", error * 100.0);
        assert!(
            error.abs() <= 0.05,
            "{what}: predicted {predicted}, measured {measured} ({:+.1}%)",
            error * 100.0
        );
    }
}

/// The policies of a model share one profile, kept in the folder's `profiles/`: a later policy
/// predicts from the kept one (here doctored to ten times its stages' bytes, which the prediction
/// must follow), and one kept for another configuration is measured anew.
#[test]
fn the_policies_of_a_model_share_one_profile() {
    let dir = out_dir("planner-shared");
    let run = |batch: &str| {
        smoke(
            &dir,
            &[
                "--matrix",
                "models",
                "--models",
                "gpt2",
                "--batch",
                batch,
                "--policies",
                "off,sqrt",
                "--rounds",
                "0",
                "--force",
            ],
        )
    };
    let predicted = |policy: &str| {
        common::record(&dir, "gpt2-tiny", policy)["predicted_peak_bytes"].as_f64().unwrap()
    };
    run("8");
    let kept = dir.join("profiles").join("gpt2-tiny.json");
    let mut shared: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&kept).unwrap()).unwrap();
    assert!(
        shared["measured_for"].as_str().unwrap().starts_with("gpt2-tiny batch 8 "),
        "{}",
        shared["measured_for"]
    );
    let honest = predicted("sqrt");
    for stage in shared["profile"]["stages"].as_array_mut().unwrap() {
        stage["graph_bytes"] = (stage["graph_bytes"].as_u64().unwrap() * 10).into();
    }
    std::fs::write(&kept, serde_json::to_string(&shared).unwrap()).unwrap();
    run("8");
    assert!(
        predicted("sqrt") > 3.0 * honest,
        "sqrt predicted {} from the doctored profile, {honest} before",
        predicted("sqrt")
    );
    run("4");
    let fresh: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&kept).unwrap()).unwrap();
    assert!(
        fresh["measured_for"].as_str().unwrap().starts_with("gpt2-tiny batch 4 "),
        "{}",
        fresh["measured_for"]
    );
    assert!(
        predicted("sqrt") < honest,
        "batch 4 measured anew: {} against batch 8's {honest}",
        predicted("sqrt")
    );
}
