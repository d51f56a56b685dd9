//! The trainer's command line under bad input. The code is `trainkit`'s, shared by every trainer;
//! GPT-2's binary stands for all four. Each test says what would go wrong without its check.

mod common;

use common::{fails_saying, fails_within, make_fifo, scratch, train};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

/// A `--save` that cannot be written fails before the first step, and leaves no temporary file.
/// Checked only at the end, it would fail after the last step, and a directory target would keep
/// `*.safetensors.partial`.
#[test]
fn an_unwritable_save_path_fails_before_training() {
    let dir = std::env::temp_dir().join(format!("cli-save-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = fails_saying(&["--steps", "3", "--save", dir.to_str().unwrap()], "is a directory");
    assert!(!err.contains("step    0"), "it trained first: {err}");
    fails_saying(
        &["--steps", "3", "--save", dir.join("no/such/folder/w.safetensors").to_str().unwrap()],
        "cannot write there",
    );
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "a temporary was left behind");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A learning rate that is not a positive finite number, and a loss that stops being finite, end
/// the run with an error, where unchecked both would run to the end with exit 0.
#[test]
fn non_finite_learning_rates_and_losses_fail() {
    fails_saying(&["--lr", "nan"], "is not a positive finite number");
    fails_saying(&["--lr=-1"], "is not a positive finite number");
    fails_saying(&["--steps", "20", "--lr", "1e30"], "not finite");
}

/// A reader that closes the pipe after one line (`2>&1 | head -1`) ends the trainer quietly, no
/// panic, with exit 141 as a process that SIGPIPE ended: the run did not do its work. `eprintln!`
/// would panic (exit 101), and a quiet exit 0 would report success for a run that neither trained
/// nor saved anything.
#[test]
fn a_closed_pipe_ends_the_run_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_train-gpt2"))
        .args(["--preset", "tiny", "--seq", "16", "--steps", "200"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    // The reader then goes away.
    BufReader::new(child.stderr.take().unwrap()).read_line(&mut first).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(trainkit::CLOSED_PIPE_EXIT), "{first}: exited with {status}");
}

/// A config.json whose values cannot describe a model names the field. Unchecked, `vocab_size: 0`
/// would be blamed on `--data` and `layer_norm_epsilon: -1` would train to the end.
#[test]
fn a_bad_config_names_its_field() {
    let dir = std::env::temp_dir().join(format!("cli-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (field, value) in [("vocab_size", "0"), ("layer_norm_epsilon", "-1")] {
        let mut config = serde_json::json!({
            "vocab_size": 256, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 2,
            "layer_norm_epsilon": 1e-5,
        });
        config[field] = serde_json::from_str(value).unwrap();
        let path = dir.join(format!("{field}.json"));
        std::fs::write(&path, config.to_string()).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_train-gpt2"))
            .args(["--config", path.to_str().unwrap(), "--steps", "1", "--seq", "16"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(field) && !err.contains("--data"),
            "{field} = {value}: {err}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Sizes this machine cannot hold are refused before anything is allocated, naming the flags and
/// the bytes. Without the check, `--batch 18446744073709551615` would panic with `capacity
/// overflow` and `--batch 100000000000` would abort with `memory allocation of ... bytes failed`.
#[test]
fn impossible_sizes_name_the_flags() {
    for batch in ["18446744073709551615", "100000000000"] {
        fails_saying(&["--batch", batch, "--steps", "1"], "--batch x --seq: the logits alone: ");
    }
}

/// `--eval-every 2` over 5 steps evaluates after steps 1, 3 and the last: printed, and logged as
/// lines of their own that leave the training losses readable. More evaluation batches than the
/// data holds samples are refused: `--eval-batches 1000` over a file of ~120 windows printed
/// "1000 held-out batches" that repeated the training windows.
#[test]
fn evaluation_runs_when_due_and_is_logged() {
    let log = std::env::temp_dir().join(format!("cli-eval-{}.jsonl", std::process::id()));
    let out = train(&["--steps", "5", "--eval-every", "2", "--log-json", log.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    for step in [1, 3, 4] {
        assert!(
            err.contains(&format!("eval after step {step}: loss")),
            "no evaluation after step {step}: {err}"
        );
    }
    assert_eq!(trainkit::read_losses(&log).unwrap().len(), 5);
    let eval = trainkit::read_eval_losses(&log).unwrap();
    assert_eq!(eval.len(), 3);
    assert!(eval.iter().all(|l| l.is_finite() && *l > 0.0), "{eval:?}");
    std::fs::remove_file(&log).unwrap();
    let dir = scratch("eval-windows");
    let tokens: Vec<u8> = (0..136u16).flat_map(|i| (i % 251).to_le_bytes()).collect();
    std::fs::write(dir.join("t.bin"), tokens).unwrap();
    let data = dir.join("t.bin");
    let args = ["--steps", "1", "--eval-every", "1", "--data", data.to_str().unwrap()];
    let err = fails_saying(&[&args[..], &["--eval-batches", "1000"]].concat(), "draw 2000 samples");
    assert!(
        err.contains("the data holds 120 distinct ones") && err.contains("at most 60"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--accumulate N` says the micro-batch and the effective batch; `--accumulate 0` is refused.
#[test]
fn accumulation_shows_the_effective_batch() {
    let out = train(&["--steps", "2", "--batch", "3", "--accumulate", "4"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success()
            && err.contains(
                "accumulating 4 micro-batches of 3 per optimizer step: effective batch 12"
            ),
        "{err}"
    );
    fails_saying(&["--accumulate", "0"], "--accumulate must be at least 1");
}

/// An unknown `--optimizer` lists the valid ones.
#[test]
fn an_unknown_optimizer_lists_the_valid_ones() {
    fails_saying(&["--optimizer", "lion"], "valid optimizers: sgd, adamw, adafactor");
}

/// `--shard-optimizer` (ZeRO stage 1) on one rank would shard nothing: refused before training.
#[test]
fn a_sharded_optimizer_needs_several_ranks() {
    fails_saying(
        &["--steps", "1", "--shard-optimizer"],
        "--shard-optimizer shares the optimizer state among data-parallel ranks",
    );
}

/// `--optimizer-in-backward` trains (its log the ordinary step's), and is refused with what needs
/// every gradient before any update: accumulation, f16 loss scaling. Unchecked, an update inside
/// the first micro-batch's backward would apply part of the step's gradient.
#[test]
fn the_optimizer_inside_backward_trains_and_refuses_what_needs_all_gradients() {
    let losses = |extra: &[&str]| {
        let out = train(&[&["--steps", "3", "--policy", "sqrt"], extra].concat());
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{extra:?}: {err}");
        err.lines()
            .filter(|l| l.trim_start().starts_with("step"))
            .filter_map(|l| {
                l.split_whitespace().skip_while(|w| *w != "loss").nth(1).map(str::to_string)
            })
            .collect::<Vec<_>>()
    };
    let (ordinary, inside) = (losses(&[]), losses(&["--optimizer-in-backward"]));
    assert!(!ordinary.is_empty() && ordinary == inside, "{ordinary:?} vs {inside:?}");
    fails_saying(
        &["--optimizer-in-backward", "--accumulate", "2"],
        "not with --accumulate above 1",
    );
    fails_saying(&["--optimizer-in-backward", "--dtype", "f16"], "not with --dtype f16");
}

/// `--ranks` in a build without MPI says which feature it needs, instead of starting mpirun on
/// processes that cannot join.
#[cfg(not(feature = "mpi"))]
#[test]
fn ranks_without_the_mpi_feature_name_it() {
    fails_saying(&["--steps", "1", "--ranks", "2"], "--features mpi");
}

/// A resume whose flags differ from the run that wrote the training snapshot is refused, naming
/// the flag and both values, the data source included; the policy may change. Checking only the
/// seed and the step would let `--batch`, `--dtype` and `--optimizer` (AdamW's moments silently
/// dropped when resuming as SGD) change while the run went on.
#[test]
fn a_resume_with_other_flags_is_refused() {
    let dir = scratch("resume-flags");
    let save = dir.join("w.safetensors");
    let save = save.to_str().unwrap();
    let out = train(&["--steps", "2", "--save", save, "--save-every", "1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let snapshot = dir.join("w.train.safetensors");
    let snapshot = snapshot.to_str().unwrap();
    let resume = |extra: &[&'static str]| -> Vec<&str> {
        [&["--steps", "3", "--resume", snapshot][..], extra].concat()
    };
    for (extra, said) in [
        (vec!["--batch", "3"], "--batch is 3 in this run but was 2"),
        (vec!["--optimizer", "sgd"], "--optimizer is sgd in this run but was adamw"),
        (vec!["--dtype", "bf16"], "--dtype is bf16 in this run but was f32"),
        (vec!["--accumulate", "2"], "--accumulate is 2 in this run but was 1"),
        (vec!["--lr", "0.1"], "--lr is 0.1 in this run but was 0.0006"),
    ] {
        fails_saying(&resume(&extra), said);
    }
    // Another data source: a token file where the snapshot's run read the synthetic corpus.
    let tokens = dir.join("tokens.bin");
    let bytes: Vec<u8> = (0..4096u32).flat_map(|i| ((i * 7 % 256) as u16).to_le_bytes()).collect();
    std::fs::write(&tokens, bytes).unwrap();
    let data = ["--steps", "3", "--resume", snapshot, "--data", tokens.to_str().unwrap()];
    let err = fails_saying(&data, "in this run but was not given");
    assert!(err.contains("--data is ") && err.contains("(8192 bytes)"), "{err}");
    let out = train(&resume(&["--policy", "off"]));
    assert!(
        out.status.success(),
        "another policy resumes: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An output path that exists and is not a regular file is refused before training, and left as
/// it was; so is one path given for two outputs. Otherwise, as root, `--save /dev/full` would turn
/// the device into a regular file, a FIFO would be replaced or fed, and a symlink would be
/// replaced by a file.
#[test]
fn outputs_must_be_regular_files_of_their_own() {
    let dir = scratch("outputs");
    let target = dir.join("target.txt");
    std::fs::write(&target, "keep me").unwrap();
    let link = dir.join("link.safetensors");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    fails_saying(&["--steps", "1", "--save", link.to_str().unwrap()], "is a symbolic link");
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    fails_saying(&["--steps", "1", "--log-json", link.to_str().unwrap()], "is a symbolic link");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep me");
    // A FIFO of the test's own, not a device of the machine's: the suite runs as root, and a
    // regression would replace /dev/null with a regular file for every later `> /dev/null`. The
    // test holds the FIFO's reading end open (non-blocking), so a regressed writer neither blocks
    // nor goes unseen: what it wrote is read back.
    let fifo = make_fifo(&dir);
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let mut reader =
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&fifo).unwrap();
    for flag in ["--save", "--log-json"] {
        fails_saying(&["--steps", "1", flag, fifo.to_str().unwrap()], "is not a regular file");
        assert!(
            std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(),
            "{flag} replaced the FIFO"
        );
        let mut written = Vec::new();
        // WouldBlock: nothing written.
        let _ = std::io::Read::read_to_end(&mut reader, &mut written);
        assert!(written.is_empty(), "{flag} wrote {} bytes into the FIFO", written.len());
    }
    let same = dir.join("same");
    let same = same.to_str().unwrap();
    fails_saying(&["--steps", "1", "--save", same, "--log-json", same], "are both");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A corrupted training snapshot or weights snapshot is refused on load, naming the file.
/// Unchecked, 0xff bytes would fail steps later with "loss is NaN ... a lower --lr may help", and
/// finite garbage would resume silently.
#[test]
fn a_corrupted_snapshot_is_detected() {
    let dir = scratch("corrupted");
    let save = dir.join("w.safetensors");
    let out = train(&["--steps", "1", "--save", save.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for (file, flag) in [("w.train.safetensors", "--resume"), ("w.safetensors", "--init")] {
        let path = dir.join(file);
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        // Finite garbage: a few bytes near the end (tensor data) changed.
        bytes[n - 40..n - 36].copy_from_slice(&1.5f32.to_le_bytes());
        let bad = dir.join(format!("bad-{file}"));
        std::fs::write(&bad, &bytes).unwrap();
        let err = fails_saying(&["--steps", "2", flag, bad.to_str().unwrap()], "is corrupted");
        assert!(err.contains(bad.to_str().unwrap()), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Options that would be ignored are refused: `--dry-run` with outputs or a resume, `--init` with
/// `--resume`, counts of 0, an evaluation that would run for days. Unchecked, each would run
/// without a word (and `--eval-batches 100000000000` would hang).
#[test]
fn options_that_would_be_ignored_are_refused() {
    for (args, said) in [
        (&["--dry-run", "--save", "w.safetensors"][..], "cannot be used with"),
        (&["--dry-run", "--log-json", "log.json"][..], "cannot be used with"),
        (&["--dry-run", "--resume", "w.train.safetensors"][..], "cannot be used with"),
        (
            &["--init", "w.safetensors", "--resume", "w.train.safetensors"][..],
            "cannot be used with",
        ),
        (&["--save", "w.safetensors", "--save-every", "0"][..], "--save-every must be at least 1"),
        (&["--eval-every", "0"][..], "--eval-every must be at least 1"),
        (&["--eval-every", "1", "--eval-batches", "0"][..], "--eval-batches must be at least 1"),
        (&["--eval-every", "1", "--eval-batches", "100000000000"][..], "is more than 10000"),
        (&["--ranks", "0"][..], "--ranks must be at least 1"),
        // A token file is already tokens: a tokenizer beside it would be ignored.
        (
            &["--data", "t.bin", "--tokenizer", "tok.json"][..],
            "'--data <DATA>' cannot be used with '--tokenizer <TOKENIZER>'",
        ),
    ] {
        fails_saying(args, said);
    }
}

/// `--help` whose output cannot be written is not a success: `--help > /dev/full` exited 0
/// having printed nothing. Into a closed pipe it ends as SIGPIPE would (141), as every line a
/// run prints does.
#[test]
fn help_that_cannot_be_written_is_not_a_success() {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_train-gpt2"))
        .arg("--help")
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(141), "{}", String::from_utf8_lossy(&out.stderr));
    let help = train(&["--help"]);
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(help.status.success() && text.contains("--policy <POLICY>"), "{text}");
}

/// Weights that cannot be the model's are refused on load, naming the file and the tensor: a
/// NaN in `--init` or `--load-adapter` surfaced only as "the gradients are not finite ... a NaN
/// or an infinity in the data (data batch 0)", an integer tensor was cast into weights, and a
/// tensor the model has not loaded without a word.
#[test]
fn weights_that_cannot_be_the_models_are_refused_naming_the_tensor() {
    use candle_core::{DType, Device, Tensor};
    let dir = scratch("bad-weights");
    let at = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let out = train(&["--steps", "1", "--save", &at("w.safetensors")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (tensors, _) = params::read_snapshot(&dir.join("w.safetensors"), &Device::Cpu).unwrap();
    let name = tensors.keys().find(|n| n.ends_with("ln_f.weight")).unwrap().clone();
    let with_nan = |t: &Tensor| {
        let mut values = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        values[3] = f32::NAN;
        Tensor::new(values, &Device::Cpu).unwrap().reshape(t.shape()).unwrap()
    };
    let edited = |name: &str, t: Tensor| {
        let mut edited = tensors.clone();
        edited.insert(name.to_string(), t);
        edited
    };
    let cases = [
        ("holds NaN (element 3 of 64)", edited(&name, with_nan(&tensors[&name]))),
        (
            "holds I64 values where the model has F32",
            edited(&name, tensors[&name].to_dtype(DType::I64).unwrap()),
        ),
        (
            "holds 1 tensors this model has not (`h.9.attn.c_attn.weight` first)",
            edited("h.9.attn.c_attn.weight", tensors[&name].clone()),
        ),
    ];
    for (said, edited) in cases {
        params::write_snapshot(&dir.join("bad.safetensors"), &edited, Default::default()).unwrap();
        let err = fails_saying(&["--steps", "1", "--init", &at("bad.safetensors")], said);
        assert!(err.contains("bad.safetensors"), "{err}");
    }
    // An adapter's NaN, through --load-adapter.
    let adapter = dir.join("adapter");
    let saved =
        train(&["--lora", "4", "--steps", "1", "--save-adapter", adapter.to_str().unwrap()]);
    assert!(saved.status.success(), "{}", String::from_utf8_lossy(&saved.stderr));
    let file = adapter.join("adapter_model.safetensors");
    let (mut tensors, _) = params::read_snapshot(&file, &Device::Cpu).unwrap();
    let a = tensors.keys().find(|n| n.contains("lora_A")).unwrap().clone();
    *tensors.get_mut(&a).unwrap() = with_nan(&tensors[&a]);
    params::write_snapshot(&file, &tensors, Default::default()).unwrap();
    let err =
        fails_saying(&["--steps", "1", "--load-adapter", adapter.to_str().unwrap()], "holds NaN");
    assert!(err.contains("adapter_model.safetensors"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A step that cannot fit is refused before it is allocated, naming the flags, with exit 1 (no
/// abort, no OOM kill). Unchecked, `--batch 1000000` would be killed by the kernel after 54 s
/// (taking the machine with it) and a config of 100000 layers would abort after 59 s.
#[test]
fn steps_and_models_that_cannot_fit_are_refused_first() {
    let start = std::time::Instant::now();
    let out = train(&["--batch", "1000000", "--steps", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--batch 1000000 x --seq 16: a training step under sqrt needs")
            && err.contains("available"),
        "{err}"
    );
    let dir = scratch("huge-config");
    let config = dir.join("config.json");
    let huge = r#"{"vocab_size": 256, "n_positions": 64, "n_embd": 1024, "n_layer": 100000,
        "n_head": 2, "layer_norm_epsilon": 1e-5}"#;
    std::fs::write(&config, huge).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_train-gpt2"))
        .args(["--config", config.to_str().unwrap(), "--seq", "16", "--steps", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(1)
            && err.contains(
                "--preset, --config or --model-id: the memory of the parameters and their \
                 gradients alone: "
            ),
        "{err}"
    );
    assert!(start.elapsed() < std::time::Duration::from_secs(60), "took {:?}", start.elapsed());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Under `--memory-cap`, a policy the planner predicts above the cap is refused before training,
/// with exit 1 and the prediction, rather than aborting at the allocation that crosses the cap
/// (SIGABRT, exit 134).
#[test]
fn a_policy_predicted_above_the_memory_cap_is_refused_before_training() {
    let out = train(&["--policy", "off", "--memory-cap", "4MiB", "--steps", "2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--policy off needs")
            && err.contains("above --memory-cap 4.0 MiB")
            && !err.contains("step    0"),
        "{err}"
    );
}

/// A cut into one segment says "1 segment".
#[test]
fn one_segment_is_singular() {
    let out = train(&["--policy", "off", "--steps", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("(1 segment)"), "{err}");
}

/// A `--log-json` that can no longer be written ends the run naming the file; a bare I/O error
/// would say only "No space left on device". A full disk is emulated without root by a file size
/// limit (RLIMIT_FSIZE, with SIGXFSZ ignored so the write fails instead of killing the process).
#[test]
fn a_log_that_cannot_be_written_names_its_file() {
    use std::os::unix::process::CommandExt;
    let dir = scratch("log-full");
    let log = dir.join("log.jsonl");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_train-gpt2"));
    cmd.args([
        "--preset",
        "tiny",
        "--seq",
        "16",
        "--steps",
        "30",
        "--log-json",
        log.to_str().unwrap(),
    ]);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: 1024, rlim_max: 1024 };
            libc::setrlimit(libc::RLIMIT_FSIZE, &limit);
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains(&format!("--log-json {}", log.display()))
            && err.contains("File too large"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--freeze` that would freeze nothing (a typo), everything, or names no pattern is refused,
/// the first with the model's parameter names; one that matches trains.
#[test]
fn a_freeze_that_matches_nothing_or_everything_is_refused() {
    for (args, said) in [
        (
            &["--freeze", "h.*.atn.*"][..],
            "--freeze h.*.atn.*: matches no parameter of this model, whose parameters are named \
             like h.0.attn",
        ),
        (&["--freeze", "*"][..], "--freeze leaves no parameter to train"),
        (&["--freeze", ","][..], "names no parameter pattern"),
    ] {
        fails_saying(args, said);
    }
    let out = train(&["--freeze", "h.*.attn.*,wte.weight", "--steps", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.contains("trained params (") && err.contains(" frozen)"),
        "{err}"
    );
}

/// `--text` that is not a regular file is refused before it is read: read whole, a FIFO whose
/// writer never closes (or `/dev/zero`) would never end. Unchecked, this run does not end: the
/// test gives it 60 s.
#[test]
fn a_text_that_is_not_a_regular_file_is_refused() {
    let dir = scratch("text-fifo");
    let fifo = make_fifo(&dir);
    // A writer that stays: a reader of the FIFO sees no end.
    let _writer = std::fs::OpenOptions::new().read(true).write(true).open(&fifo).unwrap();
    let tokenizer = dir.join("tokenizer.json");
    let text = "a tokenizer of its own, so that the run gets as far as reading the text. ";
    let kind = datasets::tokenizer::Kind::ByteLevelBpe;
    datasets::tokenizer::Tokenizer::train(kind, &text.repeat(20), 300, &tokenizer).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_train-gpt2"))
        .args(["--preset", "tiny", "--steps", "1", "--text", fifo.to_str().unwrap()])
        .args(["--tokenizer", tokenizer.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > std::time::Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("--text of a FIFO was read for 60 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("is a named pipe; give a regular file"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// What a run prints is its work: standard output on a full device ends `--dry-run` with exit 1
/// naming the stream. Unchecked, the prediction was lost and the run exited 0.
#[test]
fn output_that_cannot_be_written_fails_the_run() {
    let mut dry_run = Command::new(env!("CARGO_BIN_EXE_train-gpt2"));
    dry_run.args(["--preset", "tiny", "--seq", "16", "--dry-run"]);
    testkit::assert_fails_on_a_full_stdout(&mut dry_run);
}

/// A `+keep=` of an op the model does not run is refused, as the harness refuses it: unchecked,
/// `sqrt+keep=conv` trained GPT-2 keeping nothing and recomputing everything.
#[test]
fn a_keep_of_an_op_the_model_lacks_is_refused() {
    fails_saying(&["--steps", "1", "--policy", "sqrt+keep=conv"], "runs no conv op to keep");
}

/// No output may be a file the run reads, however it is spelled (the same path, `./`, a hard
/// link): `--init w --log-json w` turned the weights into a log, `--resume r --log-json r`
/// appended a log to the snapshot, `--data t --save t` replaced the data with weights. The input is
/// left as it was. A resume may still save over the training snapshot it resumed (the snapshot is
/// written beside it and renamed over it, after it was read).
#[test]
fn an_output_onto_an_input_is_refused_and_the_input_kept() {
    let dir = scratch("onto-input");
    let at = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let saved = train(&["--steps", "1", "--save", &at("w.safetensors"), "--save-every", "1"]);
    assert!(saved.status.success(), "{}", String::from_utf8_lossy(&saved.stderr));
    // u16 little-endian byte tokens.
    let tokens: Vec<u8> = (0..4000u16).flat_map(|i| (i * 7 % 251).to_le_bytes()).collect();
    std::fs::write(dir.join("tokens.bin"), &tokens).unwrap();
    std::fs::hard_link(dir.join("w.safetensors"), dir.join("link.safetensors")).unwrap();
    let dot = format!("{}/./tokens.bin", dir.display());
    let cases: [(&[&str], &str); 4] = [
        (&["--init", &at("w.safetensors"), "--log-json", &at("w.safetensors")], "w.safetensors"),
        (&["--init", &at("link.safetensors"), "--log-json", &at("w.safetensors")], "w.safetensors"),
        (
            &["--resume", &at("w.train.safetensors"), "--log-json", &at("w.train.safetensors")],
            "w.train.safetensors",
        ),
        (&["--data", &at("tokens.bin"), "--save", &dot], "tokens.bin"),
    ];
    for (args, input) in cases {
        let before = std::fs::read(dir.join(input)).unwrap();
        let mut all = vec!["--steps", "1"];
        all.extend_from_slice(args);
        fails_saying(&all, "would destroy its own input");
        assert!(std::fs::read(dir.join(input)).unwrap() == before, "{args:?} changed {input}");
    }
    let resumed = train(&[
        "--steps",
        "2",
        "--resume",
        &at("w.train.safetensors"),
        "--save",
        &at("w.safetensors"),
    ]);
    assert!(resumed.status.success(), "{}", String::from_utf8_lossy(&resumed.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Counts whose product or loop a step depends on are bounded: `--accumulate 2^64-1` wrapped the
/// effective batch to 0 and never ended.
#[test]
fn accumulation_beyond_its_bound_or_a_count_is_refused() {
    fails_saying(&["--steps", "1", "--accumulate", "18446744073709551615"], "is more than 1000000");
    fails_saying(
        &["--steps", "1", "--accumulate", "1000000", "--batch", "100000"],
        "an effective batch too large to count",
    );
}

/// Every file a run reads is checked before it is opened and before the model is built: a pipe
/// with no writer given as `--data`, `--init`, `--resume`, `--config`, `--tokenizer` or an
/// adapter's `adapter_config.json` blocked the run in `open` forever, and a missing `--resume`
/// was found only after the model was built (11.6 s at the medium preset).
#[test]
fn every_input_is_checked_before_anything_is_built() {
    let dir = scratch("inputs-checked");
    let fifo = make_fifo(&dir);
    let fifo = fifo.to_str().unwrap();
    let text = dir.join("a.txt");
    std::fs::write(&text, "some text to train on. ".repeat(40)).unwrap();
    let adapter = dir.join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    make_fifo(&adapter);
    std::fs::rename(adapter.join("fifo"), adapter.join("adapter_config.json")).unwrap();
    std::fs::write(adapter.join("adapter_model.safetensors"), b"").unwrap();
    let cases: [&[&str]; 6] = [
        &["--data", fifo],
        &["--init", fifo],
        &["--resume", fifo],
        &["--config", fifo],
        &["--text", text.to_str().unwrap(), "--tokenizer", fifo],
        &["--lora", "4", "--load-adapter", adapter.to_str().unwrap()],
    ];
    for args in cases {
        let preset: &[&str] = if args[0] == "--config" { &[] } else { &["--preset", "tiny"] };
        let all = [preset, &["--steps", "1"], args].concat();
        fails_within(60, &all, "is a named pipe; give a regular file");
    }
    let missing = dir.join("missing.safetensors");
    let start = std::time::Instant::now();
    let args = ["--preset", "medium", "--steps", "1", "--resume", missing.to_str().unwrap()];
    let err = fails_within(60, &args, "--resume");
    assert!(err.contains("No such file"), "{err}");
    // Building the medium model alone takes about 10 s here.
    assert!(start.elapsed().as_secs_f64() < 5.0, "refused after {:?}", start.elapsed());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A resume must read what the run that wrote the snapshot read: a `--config` with another
/// dropout, a `--text` edited to the same byte count and another tokenizer all resumed (losses
/// 5.1142 and 5.5351 against 5.1259), since the snapshot kept only the data's path and size.
#[test]
fn a_resume_on_other_inputs_is_refused() {
    let dir = scratch("resume-inputs");
    let at = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let config = gpt2::Config { vocab_size: 320, ..gpt2::Preset::Tiny.config() };
    std::fs::write(at("config.json"), serde_json::to_string(&config).unwrap()).unwrap();
    let text = "the snapshot keeps what this text holds. ".repeat(30);
    std::fs::write(at("a.txt"), &text).unwrap();
    let kind = datasets::tokenizer::Kind::ByteLevelBpe;
    let other = "another text gives another tokenizer. ".repeat(30);
    for (name, trained_on) in [("tokenizer.json", &text), ("other.json", &other)] {
        datasets::tokenizer::Tokenizer::train(kind, trained_on, 300, &dir.join(name)).unwrap();
    }
    let (config_path, text_path, tokenizer) =
        (at("config.json"), at("a.txt"), at("tokenizer.json"));
    let (save, snapshot) = (at("w.safetensors"), at("w.train.safetensors"));
    let run = |steps: &'static str, extra: &[&str]| {
        let mut args = vec!["--config", &config_path, "--text", &text_path, "--steps", steps];
        args.extend_from_slice(extra);
        Command::new(env!("CARGO_BIN_EXE_train-gpt2"))
            .args(["--seq", "16"])
            .args(&args)
            .output()
            .unwrap()
    };
    let saved = run("1", &["--tokenizer", &tokenizer, "--save", &save]);
    assert!(saved.status.success(), "{}", String::from_utf8_lossy(&saved.stderr));
    let refused = |extra: &[&str], said: &str| {
        let out = run("2", &[&["--resume", &snapshot][..], extra].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(said), "{extra:?}: {err}");
    };
    refused(&["--tokenizer", &at("other.json")], "--text's tokenizer's content is sha256:");
    let mut edited = config.clone();
    edited.attn_pdrop = 0.2;
    std::fs::write(at("config.json"), serde_json::to_string(&edited).unwrap()).unwrap();
    refused(&["--tokenizer", &tokenizer], "the model's attn_pdrop is 0.2 in this run but was 0.1");
    std::fs::write(at("config.json"), serde_json::to_string(&config).unwrap()).unwrap();
    std::fs::write(at("a.txt"), text.replacen("keeps", "holds", 1)).unwrap();
    refused(&["--tokenizer", &tokenizer], "--text's content is sha256:");
    std::fs::write(at("a.txt"), &text).unwrap();
    let resumed = run("2", &["--tokenizer", &tokenizer, "--resume", &snapshot]);
    assert!(resumed.status.success(), "{}", String::from_utf8_lossy(&resumed.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The steps of a `--log-json` file's training records, in order.
fn logged_steps(log: &std::path::Path) -> Vec<u64> {
    let text = std::fs::read_to_string(log).unwrap();
    let records = text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap());
    records.filter(|r| r.get("loss").is_some()).map(|r| r["step"].as_u64().unwrap()).collect()
}

/// Ctrl-C finished the run at once with exit 130, no word and no snapshot: the steps since the
/// last `--save-every` were lost. Now it finishes the step, writes the training snapshot, says
/// so and exits 130; the resume goes on bit for bit, and a `.partial` a killed write left beside
/// the snapshot is removed with a word.
#[test]
fn ctrl_c_writes_the_snapshot_and_the_resume_goes_on() {
    let dir = scratch("ctrl-c");
    let at = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let (save, log) = (at("w.safetensors"), at("log.jsonl"));
    let child = Command::new(env!("CARGO_BIN_EXE_train-gpt2"))
        .args(["--preset", "tiny", "--seq", "16", "--steps", "1000000"])
        .args(["--save", &save, "--save-every", "1000000", "--log-json", &log])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while std::fs::read_to_string(&log).map_or(0, |t| t.lines().count()) < 3 {
        assert!(start.elapsed().as_secs() < 120, "no step logged in 120 s");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // SAFETY: kill only sends a signal to the child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    let said = err.lines().find(|l| l.starts_with("stopped after step ")).expect(&err);
    let last: u64 = said["stopped after step ".len()..].split(';').next().unwrap().parse().unwrap();
    assert_eq!(logged_steps(std::path::Path::new(&log)), (0..=last).collect::<Vec<_>>());

    std::fs::write(at("w.partial"), b"half a snapshot").unwrap();
    let steps = (last + 3).to_string();
    let resumed = train(&[
        "--steps",
        &steps,
        "--resume",
        &at("w.train.safetensors"),
        "--save",
        &save,
        "--log-json",
        &log,
    ]);
    let err = String::from_utf8_lossy(&resumed.stderr);
    assert!(resumed.status.success() && err.contains("w.partial: left by a write"), "{err}");
    assert!(!dir.join("w.partial").exists());
    let straight = train(&["--steps", &steps, "--log-json", &at("straight.jsonl")]);
    assert!(straight.status.success());
    let bits = |path: &str| -> Vec<u32> {
        trainkit::read_losses(std::path::Path::new(path))
            .unwrap()
            .iter()
            .map(|l| l.to_bits())
            .collect()
    };
    assert_eq!(bits(&log), bits(&at("straight.jsonl")), "the resumed run differs");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A resume from a snapshot older than the log's last step trains those steps again: they were
/// appended twice (steps 150-159 twice after a Ctrl-C). The log now drops the records the
/// snapshot does not hold.
#[test]
fn a_resume_logs_each_step_once() {
    let dir = scratch("log-once");
    let at = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let log = at("log.jsonl");
    let first = train(&["--steps", "2", "--save", &at("w.safetensors"), "--log-json", &log]);
    assert!(first.status.success());
    let resume = ["--resume", &at("w.train.safetensors"), "--log-json", &log, "--steps", "4"];
    for _ in 0..2 {
        let out = train(&resume);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    assert_eq!(logged_steps(std::path::Path::new(&log)), vec![0, 1, 2, 3]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every file `train-gpt2` reads is spared by every output it writes (`--save`, `--log-json`,
/// `--save-merged`): weights, training snapshot, token file, text, configuration, the tokenizer
/// given and the one found beside `--config`, and an adapter's two files. A snapshot may replace
/// the weights it continues (`--init`/`--resume` with `--save`), so those meet `--log-json`.
#[test]
fn every_file_read_is_spared_by_every_output() {
    use testkit::cli::{assert_outputs_spare_inputs, ReadFile};
    let dir = scratch("spared");
    let at = |name: &str| dir.join(name);
    let s = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let saved = train(&["--steps", "1", "--save", &s("w.safetensors"), "--save-every", "1"]);
    assert!(saved.status.success(), "{}", String::from_utf8_lossy(&saved.stderr));
    let lora = train(&["--lora", "4", "--steps", "1", "--save-adapter", &s("adapter")]);
    assert!(lora.status.success(), "{}", String::from_utf8_lossy(&lora.stderr));
    let tokens: Vec<u8> = (0..4000u16).flat_map(|i| (i * 7 % 251).to_le_bytes()).collect();
    std::fs::write(at("tokens.bin"), tokens).unwrap();
    let text = "every file a run reads is spared. ".repeat(30);
    std::fs::write(at("a.txt"), &text).unwrap();
    std::fs::create_dir_all(at("model")).unwrap();
    let config = gpt2::Config { vocab_size: 320, ..gpt2::Preset::Tiny.config() };
    std::fs::write(at("model/config.json"), serde_json::to_string(&config).unwrap()).unwrap();
    let kind = datasets::tokenizer::Kind::ByteLevelBpe;
    for tokenizer in ["model/tokenizer.json", "tok.json"] {
        datasets::tokenizer::Tokenizer::train(kind, &text, 300, &at(tokenizer)).unwrap();
    }
    let (w, train_w, tokens) = (s("w.safetensors"), s("w.train.safetensors"), s("tokens.bin"));
    let (config, text, tok, adapter) =
        (s("model/config.json"), s("a.txt"), s("tok.json"), s("adapter"));
    let tiny = |args: &[&str]| -> Vec<String> {
        ["--preset", "tiny"].iter().chain(args).map(|a| a.to_string()).collect()
    };
    let (all, log) = (&["--save", "--log-json"][..], &["--log-json"][..]);
    let lora_outputs = &["--save", "--log-json", "--save-merged"][..];
    let with_config = ["--config", &config, "--text", &text];
    let with_tokenizer = [&with_config[..], &["--tokenizer", &tok]].concat();
    let with_adapter = tiny(&["--lora", "4", "--load-adapter", &adapter]);
    let reads = [
        ReadFile::new(&tiny(&["--init", &w]), &at("w.safetensors"), log),
        ReadFile::new(&tiny(&["--resume", &train_w]), &at("w.train.safetensors"), log),
        ReadFile::new(&tiny(&["--data", &tokens]), &at("tokens.bin"), all),
        ReadFile::new(&with_config, &at("model/config.json"), all),
        ReadFile::new(&with_config, &at("a.txt"), all),
        ReadFile::new(&with_config, &at("model/tokenizer.json"), all),
        ReadFile::new(&with_tokenizer, &at("tok.json"), all),
        ReadFile::new(&with_adapter, &at("adapter/adapter_config.json"), lora_outputs),
        ReadFile::new(&with_adapter, &at("adapter/adapter_model.safetensors"), lora_outputs),
    ];
    assert_outputs_spare_inputs(
        env!("CARGO_BIN_EXE_train-gpt2"),
        &["--seq", "16", "--steps", "1"],
        &reads,
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
