//! Harness paths the smoke matrix does not take: `--matrix gpt2-24gb` (the predictor, the skip
//! of a configuration predicted above the cap, the optimizer inside backward), `--matrix
//! llm-24gb` (a projection from two blocks, LoRA's frozen base in the state), `--baseline
//! pytorch` on a machine without torch, and `--return-freed-memory`.

mod common;
use common::{harness, matrix, models_args, out_dir, records, smoke};
use serde_json::Value;

/// `--matrix gpt2-24gb` of `models` under `sqrt` at sequence 16, one timed step, with `extra`
/// flags, into `dir`: its records (the run must succeed) and its log.
fn gpt2_24gb(dir: &std::path::Path, models: &str, extra: &[&str]) -> (Vec<Value>, String) {
    fits_24gb("gpt2-24gb", dir, models, extra)
}

/// `--matrix <matrix>` (`gpt2-24gb` or `llm-24gb`), as [`gpt2_24gb`].
fn fits_24gb(
    matrix: &str,
    dir: &std::path::Path,
    models: &str,
    extra: &[&str],
) -> (Vec<Value>, String) {
    let args = [
        "--matrix",
        matrix,
        "--models",
        models,
        "--policies",
        "sqrt",
        "--input-size",
        "16",
        "--steps",
        "1",
        "--rounds",
        "0",
    ];
    let out = harness(&[&args[..], extra, &["--out", dir.to_str().unwrap()]].concat());
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{err}");
    (records(dir), err)
}

/// The record of `model` among `recs`, which must be there (else the run's log `err` is shown).
fn find<'a>(recs: &'a [Value], model: &str, err: &str) -> &'a Value {
    recs.iter()
        .find(|r| r["model"] == model)
        .unwrap_or_else(|| panic!("no record of {model}: {err}"))
}

/// GPT-2 small, predicted at its size under the 2 GiB cap, runs, and its measured step peak
/// (the later micro-batches', which hold the tied embedding's partial gradient) is within 3% of
/// the prediction; GPT-2 medium, predicted above the cap, is skipped and says what it would have
/// needed.
#[test]
fn gpt2_24gb_predicts_and_skips_what_cannot_fit() {
    let dir = out_dir("gpt2-24gb");
    let (recs, err) = gpt2_24gb(
        &dir,
        "gpt2-small/bf16-adafactor,gpt2-medium/bf16-adafactor",
        &["--memory-cap", "2GiB"],
    );
    let small = find(&recs, "gpt2-small/bf16-adafactor", &err);
    assert_eq!(small["status"], "ok", "{}", small["error"]);
    let (predicted, measured) = (
        small["predicted_peak_bytes"].as_f64().unwrap(),
        small["fwd_bwd_peak_bytes"].as_f64().unwrap(),
    );
    let error = predicted / measured - 1.0;
    assert!(
        error.abs() < 0.03,
        "gpt2-small's step peak predicted {:+.1}% off its measured one",
        error * 100.0
    );
    let medium = find(&recs, "gpt2-medium/bf16-adafactor", &err);
    assert_eq!(medium["status"], "skipped", "{medium}");
    assert!(
        medium["error"].as_str().unwrap().starts_with("does not fit (predicted"),
        "{}",
        medium["error"]
    );
    let predicted = medium["predicted_total_bytes"].as_u64().unwrap();
    assert!(
        predicted > 2 << 30,
        "medium predicted at {predicted} bytes, under the cap it was skipped for"
    );
    assert!(std::fs::read_to_string(dir.join("TABLE.md")).unwrap().contains("gpt2-medium"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The `f32-adamw-in-backward` variant beside `f32-adamw`, both at one micro-batch: its step peak
/// as predicted (within 3%) and below the ordinary step's by at least half the gradients' bytes
/// (all but the tied embedding's are freed as they finish), its gradients plain candle's.
#[test]
fn gpt2_24gb_measures_the_optimizer_inside_backward() {
    let dir = out_dir("gpt2-24gb-in-backward");
    let (recs, err) = gpt2_24gb(
        &dir,
        "gpt2-small/f32-adamw,gpt2-small/f32-adamw-in-backward",
        &["--accumulate", "1", "--memory-cap", "4GiB"],
    );
    let (ordinary, inside) = (
        find(&recs, "gpt2-small/f32-adamw", &err),
        find(&recs, "gpt2-small/f32-adamw-in-backward", &err),
    );
    for r in [ordinary, inside] {
        assert_eq!(r["status"], "ok", "{}", r["error"]);
        assert_eq!(r["grads_bit_identical"], true, "{r}");
        let (predicted, measured) = (
            r["predicted_peak_bytes"].as_f64().unwrap(),
            r["fwd_bwd_peak_bytes"].as_f64().unwrap(),
        );
        assert!(
            (predicted / measured - 1.0).abs() < 0.03,
            "{}: step peak predicted {predicted}, measured {measured}",
            r["model"]
        );
    }
    let grads = ordinary["predicted"]["grads"].as_u64().unwrap();
    let peak = |r: &Value| r["step_peak_bytes"].as_u64().unwrap();
    assert!(
        peak(inside) + grads / 2 <= peak(ordinary),
        "step peak {} inside backward, {} after it: not half the {grads} B of gradients saved",
        peak(inside),
        peak(ordinary)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Qwen2.5-0.5B under LoRA over its bf16 base (at sequence 16, one micro-batch): its total, the
/// state by arithmetic (the base frozen: no gradients, no moments) and the step predicted from
/// a model two blocks deep whose profile was deepened to 24, within 3% of what the whole model
/// measured; gradients plain candle's; the table says what fits.
#[test]
fn llm_24gb_predicts_a_lora_fine_tune_from_two_blocks() {
    let dir = out_dir("llm-24gb");
    let model = "qwen2.5-0.5b/2048/lora-r16";
    let (recs, err) =
        fits_24gb("llm-24gb", &dir, model, &["--accumulate", "1", "--memory-cap", "8GiB"]);
    let r = find(&recs, model, &err);
    assert_eq!(r["status"], "ok", "{}", r["error"]);
    assert_eq!(r["grads_bit_identical"], true, "{r}");
    let bytes = |key: &str| r[key].as_f64().unwrap();
    let predicted = bytes("predicted_total_bytes");
    let measured = bytes("model_state_bytes") + bytes("step_peak_bytes");
    assert!(
        (predicted / measured - 1.0).abs() < 0.03,
        "total predicted {predicted} B, measured {measured} B"
    );
    // The base in bf16 (0.49 B parameters), the adapters with gradients and two f32 moments.
    let state = &r["predicted"];
    let params = state["params"].as_u64().unwrap();
    assert!((980_000_000..1_010_000_000).contains(&params), "{state}");
    assert_eq!(
        state["optimizer"].as_u64().unwrap(),
        4 * state["grads"].as_u64().unwrap(),
        "{state}"
    );
    let table = std::fs::read_to_string(dir.join("TABLE.md")).unwrap();
    assert!(table.contains("## What fits 24 GiB") && table.contains("| qwen2.5-0.5b | lora-r16 |"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Without a Python that has torch, `--baseline pytorch` says how to get one and measures ours.
#[test]
fn a_pytorch_baseline_without_torch_goes_on_without_it() {
    let dir = out_dir("no-torch");
    let extra = ["--baseline", "pytorch", "--python", "/nonexistent/python3"];
    let err = smoke(&dir, &models_args("gpt2-tiny", "off", &extra));
    assert!(err.contains("no PyTorch baseline:") && err.contains("going on without it"), "{err}");
    assert_eq!(records(&dir).len(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--baseline pytorch-compile`: the eager run beside each configuration, then the model's step
/// compiled once per budget of the sweep, each asked of the script with `--compile` and its
/// budget and stored apart, a failed compile a row with its error; a timing round times each
/// compiled run again (time only) after our policies, and stores our time over its own per round.
/// The Python is a stand-in that answers as scripts/torch_baseline.py does (CI has no torch),
/// failing the 0.2 budget, a step of 1 ms measured and 1000 s timed only.
#[test]
fn a_compiled_baseline_sweeps_the_memory_budgets() {
    let dir = out_dir("compiled");
    std::fs::create_dir_all(&dir).unwrap();
    let python = dir.join("python");
    let stand_in = r#"#!/bin/sh
[ "$1" = -c ] && exit 0
framework=pytorch budget=null ms=1.0
while [ $# -gt 0 ]; do
  case $1 in
    --model) model=$2 ;; --policy) policy=$2 ;; --batch) batch=$2 ;;
    --compile) framework=pytorch-compile ;;
    --memory-budget=*) budget=${1#--memory-budget=} ;;
    --time-only) ms=1000000.0 ;;
  esac
  shift
done
[ "$budget" = 0.2 ] && { echo "torch._dynamo.exc.BackendCompilerFailed: stand-in" >&2; exit 1; }
printf '{"framework":"%s","model":"%s","policy":"%s","batch":%s,"threads":2,"segments":1,"model_state_bytes":1,"step_peak_bytes":1000000000000,"fwd_bwd_peak_bytes":2,"step_ms_median":%s,"step_ms_min":1.0,"step_ms_max":1.0,"timed_steps":1,"loss":1.0,"compile_ms":5.0,"memory_budget":%s}\n' \
  "$framework" "$model" "$policy" "$batch" "$ms" "$budget"
"#;
    std::fs::write(&python, stand_in).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    // The smallest model the baseline has a PyTorch version of, at its `cpu` size (seconds).
    let args = [
        ["--profile", "cpu", "--steps", "1", "--out", dir.to_str().unwrap()].as_slice(),
        &["--matrix", "models", "--models", "unet3d-small", "--policies", "off", "--rounds", "1"],
        &["--baseline", "pytorch-compile", "--python", python.to_str().unwrap()],
    ]
    .concat();
    let out = harness(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let m = matrix(&dir);
    assert_eq!(m["baselines"][0]["framework"], "pytorch", "the eager run beside ours");
    let compiled = m["compiled"].as_array().expect("compiled runs stored");
    let rows: Vec<_> = compiled
        .iter()
        .map(|b| (b["policy"].as_str().unwrap(), b["status"].as_str().unwrap()))
        .collect();
    assert_eq!(
        rows,
        [
            ("memory-budget=1", "ok"),
            ("memory-budget=0.7", "ok"),
            ("memory-budget=0.4", "ok"),
            ("memory-budget=0.2", "error"),
            ("memory-budget=0.1", "ok"),
        ]
    );
    assert!(compiled.iter().all(|b| b["framework"] == "pytorch-compile"));
    assert_eq!(compiled[2]["memory_budget"], 0.4, "the budget reached the script");
    assert_eq!(compiled[0]["compile_ms"], 5.0);
    let failed = compiled[3]["error"].as_str().unwrap();
    assert!(failed.contains("BackendCompilerFailed"), "{failed}");
    // Our off (its step peak within the stand-in's) over 1 ms measured, then over 1000 s timed.
    let ours = &m["records"][0];
    let round_ms = ours["step_ms_median"].as_f64().unwrap();
    for c in compiled.iter().filter(|c| c["status"] == "ok") {
        let rounds = c["ours_over_torch"]["rounds"].as_array().expect("ratios over the rounds");
        assert_eq!(rounds.len(), 2, "{c}");
        assert_eq!(rounds[0].as_f64().unwrap(), round_ms / 1.0, "the measuring runs' ratio");
        let timed = rounds[1].as_f64().unwrap();
        assert!(timed > 0.0 && timed < round_ms / 1e3, "the round's ratio, over 1000 s: {timed}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--return-freed-memory` reaches the measured children, and their records say it was used.
#[test]
fn return_freed_memory_reaches_the_children() {
    let dir = out_dir("return-freed");
    smoke(&dir, &models_args("gpt2-tiny", "off", &["--return-freed-memory"]));
    let r = &records(&dir)[0];
    assert_eq!(r["status"], "ok", "{}", r["error"]);
    assert!(r["command"].as_str().unwrap().contains("--return-freed-memory"), "{}", r["command"]);
    std::fs::remove_dir_all(&dir).unwrap();
}
