//! What reaches the records: `--batch` and `--input-size` reach the configurations run, and
//! matrix.csv has every column of a record, each cell parsing as its type to the value in
//! matrix.json.

mod common;
use common::{harness, models_args, out_dir, record, records, smoke, smoke_args};
use serde_json::Value;

#[test]
fn batch_and_input_size_reach_the_record() {
    // The smoke profile's gpt2-tiny and resnet-tiny run at batch 2, seq 32 and 32x32.
    for (model, size, input) in [("gpt2-tiny", "8", "seq 8"), ("resnet-tiny", "48", "48x48")] {
        let dir = out_dir(&format!("resize-{model}"));
        smoke(
            &dir,
            &[
                "--matrix",
                "models",
                "--models",
                model,
                "--policies",
                "off",
                "--batch",
                "3",
                "--input-size",
                size,
            ],
        );
        let r = record(&dir, model, "off");
        assert_eq!(r["status"], "ok", "{model}: {}", r["error"]);
        assert_eq!((r["batch"].as_u64(), r["input"].as_str()), (Some(3), Some(input)), "{model}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// Each record names the command that measured it, and a folder filled by two runs lists both,
/// not only the last run's.
#[test]
fn every_record_names_the_command_that_measured_it() {
    let dir = out_dir("commands");
    smoke(&dir, &models_args("gpt2-tiny", "off", &[]));
    smoke(&dir, &models_args("gpt2-tiny", "sqrt", &[]));
    let command =
        |policy: &str| record(&dir, "gpt2-tiny", policy)["command"].as_str().unwrap().to_string();
    assert!(
        command("off").ends_with("--policies off --rounds 0")
            && command("sqrt").ends_with("--policies sqrt --rounds 0"),
        "{}",
        command("off")
    );
    let md = std::fs::read_to_string(dir.join("matrix.md")).unwrap();
    let header = md
        .lines()
        .find(|l| l.starts_with("Commands (in the order of the results they made"))
        .expect(&md);
    let at = |policy: &str| header.find(&command(policy)).unwrap_or_else(|| panic!("{header}"));
    assert!(at("off") < at("sqrt"), "{header}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--accumulate 3` reaches the record, the gradient check still passes, and the reported loss is
/// the mean of the three micro-batches' (not the first micro-batch's alone).
#[test]
fn accumulation_reaches_the_record() {
    let one = out_dir("accumulate-1");
    let three = out_dir("accumulate-3");
    smoke(&one, &models_args("gpt2-tiny", "off,sqrt", &[]));
    smoke(&three, &models_args("gpt2-tiny", "off,sqrt", &["--accumulate", "3"]));
    for policy in ["off", "sqrt"] {
        let (a, b) = (record(&one, "gpt2-tiny", policy), record(&three, "gpt2-tiny", policy));
        assert_eq!(b["status"], "ok", "{}", b["error"]);
        assert_eq!((a["accumulate"].as_u64(), b["accumulate"].as_u64()), (Some(1), Some(3)));
        assert_eq!(b["grads_bit_identical"], true);
        assert_ne!(
            a["loss"], b["loss"],
            "{policy}: the loss of three micro-batches equals the first's"
        );
    }
    // Both runs' losses agree across policies: the same micro-batches, the same keys.
    assert_eq!(
        record(&three, "gpt2-tiny", "off")["loss"],
        record(&three, "gpt2-tiny", "sqrt")["loss"]
    );
    for dir in [one, three] {
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// `--optimizer adafactor` replaces the models' default optimizers in the record, and holds less
/// state than AdamW (a factored second moment, no first moment).
#[test]
fn the_optimizer_reaches_the_record() {
    let (adamw, adafactor) = (out_dir("optimizer-default"), out_dir("optimizer-adafactor"));
    smoke(&adamw, &models_args("gpt2-tiny,resnet-tiny", "off", &[]));
    smoke(&adafactor, &models_args("gpt2-tiny,resnet-tiny", "off", &["--optimizer", "adafactor"]));
    assert_eq!(record(&adamw, "resnet-tiny", "off")["optimizer"], "sgd");
    let (a, b) = (record(&adamw, "gpt2-tiny", "off"), record(&adafactor, "gpt2-tiny", "off"));
    assert_eq!(
        (a["optimizer"].as_str(), b["optimizer"].as_str()),
        (Some("adamw"), Some("adafactor"))
    );
    assert_eq!(b["grads_bit_identical"], true);
    assert!(
        b["model_state_bytes"].as_u64() < a["model_state_bytes"].as_u64(),
        "adafactor {b} vs adamw {a}"
    );
    for dir in [adamw, adafactor] {
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// How a CSV cell must parse.
#[derive(Clone, Copy, Debug)]
enum Type {
    Str,
    Int,
    Bool,
    /// A float written with 3 decimals (times in ms).
    Ms,
    /// [`Type::Ms`], empty for null.
    OptMs,
    /// A float written exactly (an f32 value).
    F32,
    /// Always `candle`: the framework column (PyTorch rows come from `--baseline pytorch`).
    Candle,
    /// A field of the record's `time_vs_off` (3 decimals), empty where it has none.
    TimeVsOff(&'static str),
    /// An integer, empty for null.
    OptInt,
}

/// matrix.csv's columns in order, written out here rather than taken from the harness, so that a
/// column dropped, renamed or moved in the writer fails the test.
const COLUMNS: [(&str, Type); 46] = {
    use Type::*;
    [
        ("framework", Candle),
        ("model", Str),
        ("policy", Str),
        ("batch", Int),
        ("accumulate", Int),
        ("optimizer", Str),
        ("skipped_updates", Int),
        ("input", Str),
        ("dtype", Str),
        ("device", Str),
        ("threads", Int),
        ("ranks", Int),
        ("shard_optimizer", Bool),
        ("model_state_bytes", Int),
        ("step_peak_bytes", Int),
        ("fwd_bwd_peak_bytes", Int),
        ("activation_peak_bytes", Int),
        ("rss_peak_delta_bytes", Int),
        ("minor_faults_per_step", OptInt),
        ("reserved_bytes", OptInt),
        ("model_state_bytes_max_rank", OptInt),
        ("step_peak_bytes_max_rank", OptInt),
        ("step_ms_median", Ms),
        ("step_ms_min", Ms),
        ("step_ms_max", Ms),
        ("all_reduce_ms", OptMs),
        ("all_reduce_wait_ms", OptMs),
        ("timed_steps", Int),
        ("segments", Int),
        ("loss", F32),
        ("grads_bit_identical", Bool),
        ("grads_checked", Bool),
        ("predicted_total_bytes", OptInt),
        ("predicted_peak_bytes", OptInt),
        ("predicted_time_ratio", OptMs),
        ("plan", Str),
        ("grads_differing", Int),
        ("max_abs_diff", F32),
        ("params_without_grad", Int),
        ("check_skipped", Str),
        ("status", Str),
        ("commit", Str),
        ("error", Str),
        ("time_vs_off_median", TimeVsOff("median")),
        ("time_vs_off_min", TimeVsOff("min")),
        ("time_vs_off_max", TimeVsOff("max")),
    ]
};

/// Record fields that are JSON only: the timeline, the segments' stage ranges, the time / off
/// rounds (the CSV has their median and range) and the command (the Markdown lists them).
const JSON_ONLY: [&str; 8] = [
    "timeline",
    "timeline_base_bytes",
    "segment_ranges",
    "time_vs_off",
    "predicted",
    "frontier",
    "estimate",
    "command",
];

/// The cells of one CSV line: fields in double quotes may hold commas, and `""` for a quote.
fn cells(line: &str) -> Vec<String> {
    let (mut out, mut cell, mut quoted) = (Vec::new(), String::new(), false);
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                cell.push('"');
                chars.next();
            }
            '"' => quoted = !quoted,
            ',' if !quoted => out.push(std::mem::take(&mut cell)),
            c => cell.push(c),
        }
    }
    out.push(cell);
    out
}

/// Whether `cell` parses as `ty` to the JSON value `want` (the record's field of that name, or
/// the whole record for the derived columns).
fn matches(cell: &str, ty: Type, want: &Value) -> bool {
    match ty {
        Type::Candle => cell == "candle",
        Type::TimeVsOff(field) => match want["time_vs_off"].get(field) {
            None => cell.is_empty(),
            Some(v) => matches(cell, Type::Ms, v),
        },
        Type::Str => want.as_str() == Some(cell),
        Type::Int => cell.parse::<u64>().ok() == want.as_u64(),
        Type::OptInt => {
            if want.is_null() {
                cell.is_empty()
            } else {
                cell.parse::<u64>().ok() == want.as_u64()
            }
        }
        Type::Bool => cell.parse::<bool>().ok() == want.as_bool(),
        Type::Ms => {
            cell.parse::<f64>().is_ok_and(|x| want.as_f64().is_some_and(|w| (x - w).abs() <= 5e-4))
        }
        Type::OptMs if want.is_null() => cell.is_empty(),
        Type::OptMs => {
            cell.parse::<f64>().is_ok_and(|x| want.as_f64().is_some_and(|w| (x - w).abs() <= 5e-4))
        }
        Type::F32 => cell.parse::<f32>().ok() == want.as_f64().map(|w| w as f32),
    }
}

#[test]
fn every_csv_column_is_written_and_parses_to_the_json_value() {
    let dir = out_dir("csv");
    // A recorded gradient mismatch (non-zero differing, max_abs_diff) and a failed configuration
    // (status, error text) beside ordinary figures.
    smoke(
        &dir,
        &["--matrix", "models", "--models", "gpt2-tiny", "--policies", "sqrt", "--no-rng-replay"],
    );
    // Every configuration of this run out of memory: recorded, and the harness exits non-zero.
    let args = [
        "--matrix",
        "models",
        "--models",
        "bert-tiny",
        "--policies",
        "off",
        "--memory-cap",
        "2MiB",
    ];
    let out = harness(&smoke_args(&dir, &args));
    assert!(
        !out.status.success()
            && String::from_utf8_lossy(&out.stderr)
                .contains("every configuration ran out of memory")
    );
    let recs = records(&dir);
    assert_eq!(recs.len(), 2);
    assert_eq!(recs[1]["status"], "oom", "{}", recs[1]);

    let csv = std::fs::read_to_string(dir.join("matrix.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    assert_eq!(header, COLUMNS.map(|(c, _)| c), "matrix.csv header");
    let mut fields: Vec<&str> = recs[0]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .filter(|k| !JSON_ONLY.contains(k))
        .collect();
    fields.sort_unstable();
    let mut sorted: Vec<&str> = header
        .iter()
        .copied()
        .filter(|c| {
            !matches!(
                COLUMNS.iter().find(|(n, _)| n == c),
                Some((_, Type::Candle | Type::TimeVsOff(_)))
            )
        })
        .collect();
    sorted.sort_unstable();
    assert_eq!(sorted, fields, "a record field is missing from matrix.csv");

    let rows: Vec<&str> = lines.collect();
    assert_eq!(rows.len(), recs.len());
    for (row, rec) in rows.iter().zip(&recs) {
        let cells = cells(row);
        assert_eq!(cells.len(), COLUMNS.len(), "{row}");
        for ((name, ty), cell) in COLUMNS.iter().zip(&cells) {
            let want =
                if matches!(ty, Type::Candle | Type::TimeVsOff(_)) { rec } else { &rec[name] };
            assert!(
                matches(cell, *ty, want),
                "{} {}: column {name} is `{cell}`, matrix.json has {}",
                rec["model"],
                rec["policy"],
                rec[name]
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
