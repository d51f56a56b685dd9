//! Running the `train-gpt2` binary at the tiny preset, as the command-line tests do. Each test file
//! uses a part of it.
#![allow(dead_code)]

use std::process::Command;

pub fn train(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_train-gpt2"))
        .args(["--preset", "tiny", "--seq", "16"])
        .args(args)
        .output()
        .unwrap()
}

pub fn fails_saying(args: &[&str], needle: &str) -> String {
    let out = train(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success() && !err.contains("panicked") && err.contains(needle),
        "{args:?}: {err}"
    );
    err
}

/// A scratch folder of its own for a test.
pub fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A FIFO named `fifo` in `dir`.
pub fn make_fifo(dir: &std::path::Path) -> std::path::PathBuf {
    let fifo = dir.join("fifo");
    let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `path` is a NUL-terminated string that outlives the call, which only reads it.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0, "mkfifo {}", fifo.display());
    fifo
}

/// `train-gpt2 args` that must fail within `secs` seconds saying `needle`: a run that blocks (on
/// a pipe with no writer) is killed and the test fails.
pub fn fails_within(secs: u64, args: &[&str], needle: &str) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_train-gpt2"))
        .args(["--seq", "16"])
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > std::time::Duration::from_secs(secs) {
            child.kill().unwrap();
            panic!("{args:?} still ran after {secs} s");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        !out.status.success() && !err.contains("panicked") && err.contains(needle),
        "{args:?}: {err}"
    );
    err
}
