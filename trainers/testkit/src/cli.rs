//! Running a trainer binary as a user does: its log read back, its losses falling, a resumed run
//! bit-identical to an uninterrupted one, a full standard output refused.

use candle_core::Device;
use std::path::Path;
use trainkit::read_losses;

/// `cmd` with its standard output on a full device (`/dev/full`) ends with exit 1, naming the
/// stream: what a run prints is its work, and a run whose output is lost has not done it.
pub fn assert_fails_on_a_full_stdout(cmd: &mut std::process::Command) {
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let out = cmd.stdout(full).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(1) && err.contains("writing to standard output"),
        "{:?}: {err}",
        out.status
    );
}

/// Runs the trainer binary `bin` with `args` and `--log-json`; it must succeed. Returns the
/// per-step training losses and what it printed on stderr.
pub fn run_logged(bin: &str, args: &[&str]) -> (Vec<f32>, String) {
    let log = std::env::temp_dir().join(format!(
        "run-logged-{}-{:x}.jsonl",
        std::process::id(),
        args_hash(args)
    ));
    let out = std::process::Command::new(bin)
        .args(args)
        .args(["--log-json", log.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{bin} {args:?}: {err}");
    let losses = read_losses(&log).unwrap();
    std::fs::remove_file(&log).unwrap();
    (losses, err)
}

/// A name for `args` (tests of one binary run in parallel, each with its own files).
fn args_hash(args: &[&str]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    args.hash(&mut h);
    h.finish()
}

/// Fails unless the mean of the last five losses is below the mean of the first five by `margin`.
pub fn assert_loss_falls(losses: &[f32], margin: f32, what: &str) {
    let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
    let (first, last) = (mean(&losses[..5]), mean(&losses[losses.len() - 5..]));
    assert!(
        last < first - margin,
        "{what}: the loss went from {first:.3} to {last:.3} (needs a fall of {margin}): {losses:?}"
    );
}

/// Runs the trainer binary `bin` (with its model and size flags `args`) for 4 steps straight, and
/// for 2 steps with a training snapshot followed by `--resume` to step 4: the per-step losses and
/// the final weights snapshot must be the same bits. Without a training snapshot, `--init` would
/// restart at step 0 with fresh optimizer state and its losses would differ from step 1 on.
pub fn assert_resume_is_bit_identical(bin: &str, args: &[&str]) {
    let name = Path::new(bin).file_name().unwrap().to_string_lossy().into_owned();
    let dir = std::env::temp_dir().join(format!(
        "resume-{name}-{}-{:x}",
        std::process::id(),
        args_hash(args)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(bin)
            .args(args)
            .args(["--policy", "sqrt"])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{bin} {args:?} {extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&[
        "--steps",
        "4",
        "--save",
        &path("straight.safetensors"),
        "--log-json",
        &path("straight.json"),
    ]);
    run(&[
        "--steps",
        "2",
        "--save",
        &path("cut.safetensors"),
        "--save-every",
        "2",
        "--log-json",
        &path("cut.json"),
    ]);
    run(&[
        "--steps",
        "4",
        "--save",
        &path("cut.safetensors"),
        "--resume",
        &path("cut.train.safetensors"),
        "--log-json",
        &path("cut.json"),
    ]);
    let losses = |name: &str| {
        read_losses(&dir.join(name)).unwrap().into_iter().map(f32::to_bits).collect::<Vec<_>>()
    };
    assert_eq!(losses("straight.json").len(), 4);
    assert_eq!(losses("cut.json"), losses("straight.json"), "losses of the resumed run");
    let weights = |name: &str| -> std::collections::BTreeMap<String, Vec<u32>> {
        candle_core::safetensors::load(dir.join(name), &Device::Cpu)
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, params::f32_bits(&t).unwrap()))
            .collect()
    };
    assert_eq!(
        weights("cut.safetensors"),
        weights("straight.safetensors"),
        "final weights of the resumed run"
    );
    // Snapshots are readable by all (0644, not 0600), as other tools write files.
    #[cfg(unix)]
    for name in ["cut.safetensors", "cut.train.safetensors"] {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(dir.join(name)).unwrap().permissions().mode() & 0o777,
            0o644,
            "{name}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A file a trainer reads, for [`assert_outputs_spare_inputs`]: the flags that make a run read
/// it, the file, and the output flags to aim at it.
pub struct ReadFile<'a> {
    pub args: Vec<String>,
    pub file: std::path::PathBuf,
    pub outputs: &'a [&'a str],
}

impl<'a> ReadFile<'a> {
    /// `file`, read through `args`, aimed at by each of `outputs`.
    pub fn new(args: &[impl AsRef<str>], file: &Path, outputs: &'a [&'a str]) -> Self {
        let args = args.iter().map(|a| a.as_ref().to_string()).collect();
        ReadFile { args, file: file.to_path_buf(), outputs }
    }
}

/// No output of the trainer `bin` may be a file it reads: a run given (after `base`) the flags
/// that make it read a file and that file as one of its outputs is refused, saying it would
/// destroy its own input, and the file is left as it was.
pub fn assert_outputs_spare_inputs(bin: &str, base: &[&str], reads: &[ReadFile]) {
    for read in reads {
        let before = std::fs::read(&read.file).unwrap();
        for output in read.outputs {
            let out = std::process::Command::new(bin)
                .args(base)
                .args(&read.args)
                .args([output, read.file.to_str().unwrap()])
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                !out.status.success() && err.contains("would destroy its own input"),
                "{:?} {output} onto it: {err}",
                read.args
            );
            let after = std::fs::read(&read.file).unwrap();
            assert!(after == before, "{:?} {output} changed {}", read.args, read.file.display());
        }
    }
}

/// Trains `bin args` on two ranks (`--ranks 2`, Open MPI's `mpirun`) under each of `policies`,
/// the first `off`: every rank's parameters must end bit-identical (the trainer checks and says
/// so), and every policy's snapshot must equal `off`'s bit for bit. Returns `off`'s snapshot,
/// each tensor's f32 bits by name.
pub fn assert_two_ranks_checkpoint_as_off(
    bin: &str,
    args: &[&str],
    policies: &[&str],
) -> std::collections::BTreeMap<String, Vec<u32>> {
    assert_eq!(policies.first(), Some(&"off"), "the first policy is the reference");
    let dir = std::env::temp_dir().join(format!("two-ranks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let snapshot = |policy: &str| {
        let path = dir.join(format!("{policy}.safetensors"));
        let out = std::process::Command::new(bin)
            .args(args)
            .args(["--ranks", "2", "--policy", policy, "--save", path.to_str().unwrap()])
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success()
                && log.contains("ranks in sync: parameters bit-identical on all 2 ranks"),
            "{policy}: {log}"
        );
        candle_core::safetensors::load(&path, &Device::Cpu)
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, params::f32_bits(&t).unwrap()))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let off = snapshot("off");
    for policy in &policies[1..] {
        assert!(snapshot(policy) == off, "{policy}: two-rank weights differ from two-rank off");
    }
    std::fs::remove_dir_all(&dir).unwrap();
    off
}
