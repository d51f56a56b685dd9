//! Data parallelism over MPI (`cargo test -p gpt2 --features mpi --test mpi`; needs Open MPI's
//! `mpirun`): two ranks of batch B train as one rank of batch 2B; ranks stay bit-identical;
//! checkpointing keeps two-rank gradients bit-identical to two-rank `off`; a sharded optimizer
//! (ZeRO stage 1) trains, saves and resumes bit for bit as an unsharded one; ranks given
//! different policies stop; a failing rank ends every rank with its error instead of a hang.
#![cfg(feature = "mpi")]

use candle_core::Device;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use trainable::Model;
use trainable::ModelConfig;

const BIN: &str = env!("CARGO_BIN_EXE_train-gpt2");

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gpt2-mpi-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `cmd`, killing it after `limit`: a hung rank fails the test instead of hanging it.
fn run_within(mut cmd: Command, limit: Duration) -> Output {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            child.kill().unwrap();
            panic!("still running after {limit:?}: the ranks hang");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    child.wait_with_output().unwrap()
}

fn train(args: &[&str]) -> String {
    let mut cmd = Command::new(BIN);
    cmd.args(["--seq", "16"]).args(args);
    let out = run_within(cmd, Duration::from_secs(300));
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{args:?}: {log}");
    log
}

fn weights(path: &Path) -> BTreeMap<String, Vec<f32>> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1().unwrap()))
        .collect()
}

/// A tiny GPT-2 without dropout: the comparison with one rank needs the same computation.
fn no_dropout_config(dir: &Path) -> String {
    let cfg = gpt2::Config {
        embd_pdrop: 0.0,
        attn_pdrop: 0.0,
        resid_pdrop: 0.0,
        ..gpt2::Config::tiny(2, 32)
    };
    let path = dir.join("config.json");
    std::fs::write(&path, serde_json::to_string(&cfg).unwrap()).unwrap();
    path.to_string_lossy().into_owned()
}

#[test]
fn two_ranks_of_b_train_as_one_rank_of_2b() {
    let dir = temp_dir("equal");
    let config = no_dropout_config(&dir);
    let path = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let common = ["--config", &config, "--optimizer", "sgd", "--lr", "0.1", "--policy", "sqrt"];
    let log = train(
        &[
            &common[..],
            &["--ranks", "2", "--batch", "4", "--steps", "1", "--save", &path("two.safetensors")],
        ]
        .concat(),
    );
    assert!(log.contains("data parallel: 2 ranks"), "{log}");
    train(
        &[&common[..], &["--batch", "8", "--steps", "1", "--save", &path("one.safetensors")]]
            .concat(),
    );
    let (two, one) = (weights(&dir.join("two.safetensors")), weights(&dir.join("one.safetensors")));
    let model =
        gpt2::Gpt2::new(gpt2::Config::from_json(Path::new(&config)).unwrap(), &Device::Cpu, 0)
            .unwrap(); // --seed 0
    let start: BTreeMap<String, Vec<f32>> = model
        .params()
        .named()
        .map(|(n, v)| (n.to_string(), v.as_tensor().flatten_all().unwrap().to_vec1().unwrap()))
        .collect();
    let (mut worst, mut moved) = (0f32, 0f32);
    for (name, w) in &one {
        for ((a, b), s) in w.iter().zip(&two[name]).zip(&start[name]) {
            worst = worst.max((a - b).abs());
            moved = moved.max((a - s).abs());
        }
    }
    eprintln!(
        "largest difference, 2 ranks x 4 against 1 rank x 8 after one SGD step: {worst:.1e} \
         (largest update {moved:.1e})"
    );
    assert!(moved > 1e-3 && worst <= 1e-6, "difference {worst}, update {moved}");

    // Three steps: every rank ends with the same bits (the trainer compares their hashes).
    let log = train(&[&common[..], &["--ranks", "2", "--batch", "4", "--steps", "3"]].concat());
    assert!(log.contains("ranks in sync: parameters bit-identical on all 2 ranks"), "{log}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn checkpointing_keeps_two_rank_gradients_bit_identical() {
    let dir = temp_dir("policies");
    let snapshot = |policy: &str| {
        let path = dir.join(format!("{policy}.safetensors"));
        // Dropout on (the preset's 0.1): each rank draws its own masks, replayed on recompute.
        train(&[
            "--preset",
            "tiny",
            "--ranks",
            "2",
            "--batch",
            "2",
            "--steps",
            "2",
            "--policy",
            policy,
            "--save",
            path.to_str().unwrap(),
        ]);
        candle_core::safetensors::load(&path, &Device::Cpu)
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, params::f32_bits(&t).unwrap()))
            .collect::<BTreeMap<_, _>>()
    };
    let off = snapshot("off");
    for policy in ["sqrt", "every-two-blocks"] {
        assert!(snapshot(policy) == off, "{policy}: two-rank weights differ from two-rank off");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every tensor of a safetensors file, as bits.
fn bits(path: &Path) -> BTreeMap<String, Vec<u32>> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, params::f32_bits(&t).unwrap()))
        .collect()
}

#[test]
fn a_sharded_optimizer_trains_saves_and_resumes_as_an_unsharded_one() {
    let dir = temp_dir("sharded");
    let path = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let run = |extra: &[&str]| {
        train(
            &[
                &[
                    "--preset",
                    "tiny",
                    "--ranks",
                    "2",
                    "--batch",
                    "2",
                    "--optimizer",
                    "adamw",
                    "--policy",
                    "sqrt",
                ][..],
                extra,
            ]
            .concat(),
        )
    };
    run(&["--steps", "3", "--save", &path("plain.safetensors")]);
    let log = run(&["--steps", "3", "--save", &path("sharded.safetensors"), "--shard-optimizer"]);
    // Each rank holds about half of AdamW's two moments.
    let share = log
        .lines()
        .find_map(|l| l.strip_prefix("optimizer state sharded over 2 ranks (ZeRO stage 1): "))
        .expect(&log);
    let mib: Vec<f64> =
        share.split(" MiB").filter_map(|s| s.rsplit(' ').next()?.parse().ok()).collect();
    assert!(mib.len() == 2 && mib[0] < 0.6 * mib[1], "{share}");
    assert!(log.contains("ranks in sync: parameters bit-identical on all 2 ranks"), "{log}");
    // The same weights, and the same training snapshot: the state gathered on rank 0 under the
    // unsharded optimizer's names.
    assert!(
        bits(&dir.join("sharded.safetensors")) == bits(&dir.join("plain.safetensors")),
        "sharded weights differ"
    );
    assert!(
        bits(&dir.join("sharded.train.safetensors")) == bits(&dir.join("plain.train.safetensors")),
        "sharded training snapshot differs"
    );
    // Cut after 2 steps, resumed to 3, sharded and not: the straight run's weights.
    run(&["--steps", "2", "--save", &path("cut.safetensors"), "--shard-optimizer"]);
    for (name, shard) in [("resumed-sharded", true), ("resumed-plain", false)] {
        let save = path(&format!("{name}.safetensors"));
        let args = ["--steps", "3", "--save", &save, "--resume", &path("cut.train.safetensors")];
        run(&[&args[..], if shard { &["--shard-optimizer"][..] } else { &[] }].concat());
        assert!(
            bits(Path::new(&save)) == bits(&dir.join("plain.safetensors")),
            "{name}: weights differ from the straight run's"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Two ranks started by one `mpirun` with their own arguments (a multiple-program launch).
fn two_ranks(rank0: &[&str], rank1: &[&str]) -> Output {
    let mut cmd = Command::new("mpirun");
    cmd.args(["-np", "1", BIN]).args(rank0).args([":", "-np", "1", BIN]).args(rank1);
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("RAYON_NUM_THREADS", "1");
    run_within(cmd, Duration::from_secs(120))
}

#[test]
fn a_failing_rank_ends_every_rank_with_its_error() {
    let rank = ["--preset", "tiny", "--seq", "16", "--steps", "50"];
    let out = two_ranks(&rank, &[&rank[..], &["--data", "/no/such/tokens.bin"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("rank 1 of 2") && err.contains("/no/such/tokens.bin"), "{err}");
}

/// Ranks given different policies would start different gradient sums: they stop at once. A
/// plan resolved from a budget (which depends on each rank's measurements and, sharded, its
/// share of the state) is rank 0's on every rank.
#[test]
fn ranks_checkpoint_in_sync_or_not_at_all() {
    let rank = ["--preset", "tiny", "--seq", "16", "--steps", "2"];
    let out = two_ranks(
        &[&rank[..], &["--policy", "sqrt"]].concat(),
        &[&rank[..], &["--policy", "off"]].concat(),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(
            "rank 1 was given --policy off, rank 0 sqrt: every rank must checkpoint in sync"
        ),
        "{err}"
    );
    let log = train(&[
        "--preset",
        "tiny",
        "--ranks",
        "2",
        "--batch",
        "2",
        "--steps",
        "2",
        "--policy",
        "auto",
        "--shard-optimizer",
    ]);
    assert!(log.contains("ranks in sync: parameters bit-identical on all 2 ranks"), "{log}");
}
