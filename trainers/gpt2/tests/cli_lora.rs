//! The trainer's LoRA flags on the command line: adapters trained, written and merged, loaded as
//! their `adapter_config.json` says, and the bad combinations refused before training. GPT-2's
//! binary stands for every trainer whose model takes adapters.

mod common;

use common::{fails_saying, make_fifo, scratch, train};

/// `--lora`: targets that adapt nothing and combinations that cannot hold are refused, naming
/// the model's layers; a LoRA run trains the adapters alone and writes the adapter in PEFT's
/// layout and the merged weights, which `--init` loads into the model without adapters.
#[test]
fn lora_trains_adapters_writes_them_and_merges() {
    for (args, said) in [
        (
            &["--lora", "4", "--lora-targets", "c_atn"][..],
            "--lora-targets c_atn: matches no layer this model adapts (its layers: c_attn, c_proj, \
             c_fc)",
        ),
        (&["--lora", "0"][..], "the LoRA rank must be at least 1"),
        (&["--lora", "4", "--freeze", "wte.weight"][..], "cannot be used with"),
        (&["--lora-alpha", "8"][..], "--lora <LORA>"),
    ] {
        fails_saying(args, said);
    }
    let dir = scratch("lora");
    let (adapter, merged) = (dir.join("adapter"), dir.join("merged.safetensors"));
    let out = train(&[
        "--lora",
        "4",
        "--steps",
        "2",
        "--lr",
        "1e-2",
        "--save-adapter",
        adapter.to_str().unwrap(),
        "--save-merged",
        merged.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success()
            && err.contains("trained params (")
            && err.contains("saved adapter to"),
        "{err}"
    );
    assert!(
        adapter.join("adapter_model.safetensors").is_file()
            && adapter.join("adapter_config.json").is_file(),
        "{err}"
    );
    let out = train(&["--init", merged.to_str().unwrap(), "--strict", "--steps", "1"]);
    assert!(
        out.status.success(),
        "the merged weights do not load into the model without adapters: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = train(&["--lora", "4", "--load-adapter", adapter.to_str().unwrap(), "--steps", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("adapter from"), "{err}");
    // Adapters this model has not (a config that lists fewer targets than the file holds) are
    // extra, not "missing".
    let config = adapter.join("adapter_config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let fewer = text.replace(
        r#""c_attn",
    "c_fc",
    "c_proj""#,
        r#""c_attn""#,
    );
    assert_ne!(fewer, text, "the targets as --save-adapter writes them");
    std::fs::write(&config, fewer).unwrap();
    let out = train(&["--load-adapter", adapter.to_str().unwrap(), "--steps", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("is not an adapter of this model")
            && !err.contains("is missing"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The first step's loss a run prints.
fn first_loss(out: &std::process::Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err.lines().find(|l| l.starts_with("step    0")).unwrap_or_else(|| panic!("{err}"));
    line.split_whitespace().nth(3).unwrap().to_string()
}

/// `--load-adapter` takes the adapter as its `adapter_config.json` says (rank, alpha, dropout,
/// targets): a flag that contradicts it is refused naming both values, and a configuration that
/// is missing, not JSON, or asks for what is not implemented is refused naming the key. Without
/// it, an adapter saved at alpha 16 and loaded with `--lora 4` ran at alpha 4 (another loss,
/// exit 0), and `"r": 8`, `"use_rslora": true` or `{not json` were accepted.
#[test]
fn a_loaded_adapter_is_what_its_adapter_config_says() {
    let dir = scratch("adapter-config");
    let adapter = dir.join("adapter");
    let a = adapter.to_str().unwrap();
    let out = train(&["--lora", "4", "--lora-alpha", "16", "--steps", "1", "--save-adapter", a]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let as_saved =
        train(&["--lora", "4", "--lora-alpha", "16", "--steps", "1", "--load-adapter", a]);
    for implied in [&["--lora", "4"][..], &[]] {
        let out = train(&[implied, &["--steps", "1", "--load-adapter", a]].concat());
        assert_eq!(first_loss(&out), first_loss(&as_saved), "{implied:?}: not at alpha 16");
    }
    fails_saying(
        &["--lora", "8", "--load-adapter", a],
        &format!("--lora 8 contradicts the adapter's `r` 4 in {a}/adapter_config.json"),
    );
    fails_saying(&["--load-adapter", a, "--lora-alpha", "8"], "--lora-alpha 8 contradicts");
    fails_saying(&["--load-adapter", a, "--lora-dropout", "0.1"], "`lora_dropout` 0");
    fails_saying(&["--load-adapter", a, "--lora-targets", "c_fc"], "`target_modules` c_");
    let config = adapter.join("adapter_config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    for (edit, said) in [
        (text.replace(r#""r": 4"#, r#""r": 8"#), "has shape [4, 64], the model expects [8, 64]"),
        (
            text.replace(r#""use_rslora": false"#, r#""use_rslora": true"#),
            "`use_rslora` is true: not supported",
        ),
        (text.replace(r#""bias": "none""#, r#""bias": "all""#), r#"`bias` is "all""#),
        (text.replace(r#""peft_type": "LORA""#, r#""peft_type": "IA3""#), "`peft_type`"),
        ("{not json".into(), "adapter_config.json: not JSON"),
    ] {
        assert_ne!(edit, text, "{said}: the edit did not apply");
        std::fs::write(&config, edit).unwrap();
        fails_saying(&["--load-adapter", a], said);
    }
    std::fs::remove_file(&config).unwrap();
    fails_saying(&["--load-adapter", a], "adapter_config.json: No such file");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A LoRA rank above the width of the layers it adapts is refused naming `--lora`: unchecked,
/// `--lora 100000` on a 64-wide model trained 409.6M adapter parameters, and `--lora 1000000000`
/// failed naming `--preset`.
#[test]
fn a_lora_rank_above_the_layers_width_is_refused() {
    for rank in ["100000", "1000000000"] {
        fails_saying(&["--steps", "1", "--lora", rank], "is above the width 64 of the layers");
    }
}

/// Every path a run writes is checked before training, by the check `--save` has: unchecked,
/// `--save-merged` onto a device replaced it with a regular file, `--save-merged X --save X` kept
/// only the merged weights, and `--save-adapter` onto a file or a link failed only after
/// training, or wrote where the link pointed.
#[test]
fn lora_outputs_are_checked_before_training() {
    let dir = scratch("lora-outputs");
    let fifo = make_fifo(&dir);
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    // The reading end held open, so that a regressed writer neither blocks nor goes unseen.
    let _reader =
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&fifo).unwrap();
    let file = dir.join("file.txt");
    std::fs::write(&file, "keep me").unwrap();
    std::fs::create_dir_all(dir.join("elsewhere")).unwrap();
    let link = dir.join("link");
    std::os::unix::fs::symlink(dir.join("elsewhere"), &link).unwrap();
    let same = dir.join("same.safetensors");
    let [fifo_s, file_s, link_s, same_s] =
        [&fifo, &file, &link, &same].map(|p| p.to_str().unwrap().to_string());
    for (args, said) in [
        (vec!["--save-merged", &fifo_s], "is not a regular file"),
        (vec!["--save-merged", &same_s, "--save", &same_s], "are both"),
        (vec!["--save-adapter", &file_s], "exists and is not a folder"),
        (vec!["--save-adapter", &link_s], "is a symbolic link"),
        (vec!["--save-adapter", &same_s, "--save", &same_s], "are both"),
    ] {
        let args = [&["--steps", "1", "--lora", "4"][..], &args].concat();
        fails_saying(&args, said);
    }
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(), "the FIFO replaced");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
    assert!(std::fs::read_dir(dir.join("elsewhere")).unwrap().next().is_none(), "wrote via link");
    assert!(!same.exists(), "a refused run wrote {}", same.display());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--init` of a LoRA run's snapshot into a model without those adapters, or with adapters of
/// another rank or alpha, is refused, naming the adapters and the ways on; with them, it loads. Unchecked, the adapter tensors were dropped
/// without a word and the run started from the base weights, the fine-tuning lost.
#[test]
fn init_of_a_lora_snapshot_keeps_its_adapters_or_is_refused() {
    let dir = scratch("init-lora");
    let snapshot = dir.join("lora.safetensors");
    let s = snapshot.to_str().unwrap();
    let out = train(&["--lora", "4", "--steps", "1", "--save", s]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let err = fails_saying(&["--steps", "1", "--init", s], "holds 32 LoRA adapter tensors");
    assert!(err.contains("give --lora (and --lora-targets) as that run did"), "{err}");
    fails_saying(
        &["--lora", "4", "--lora-targets", "c_fc", "--steps", "1", "--init", s],
        "holds 24 LoRA adapter tensors this model has not",
    );
    // Adapters of another rank trained the base without them (their shapes did not fit, so they
    // were initialised instead) and another alpha rescaled them, both without a word.
    for (flags, said) in [
        (&["--lora", "2"][..], "adapters of rank 4, alpha 4, this run's are rank 2, alpha 2"),
        (&["--lora", "8"][..], "adapters of rank 4, alpha 4, this run's are rank 8, alpha 8"),
        (&["--lora", "4", "--lora-alpha", "64"][..], "this run's are rank 4, alpha 64"),
    ] {
        fails_saying(&[flags, &["--steps", "1", "--init", s]].concat(), said);
    }
    let out = train(&["--lora", "4", "--steps", "1", "--init", s]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}
