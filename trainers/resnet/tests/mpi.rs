//! Data parallelism for a model with BatchNorm (`cargo test -p resnet --features mpi --test mpi`;
//! needs Open MPI's `mpirun`): on two ranks, every policy ends with the weights and running
//! statistics of `off`, bit for bit, and the ranks stay in sync. It covers data parallelism with
//! BatchNorm, which GPT-2's rank tests do not reach.
#![cfg(feature = "mpi")]

use candle_core::Device;
use std::collections::BTreeMap;
use std::process::Command;

#[test]
fn two_resnet_ranks_checkpoint_bit_identically() {
    let dir = std::env::temp_dir().join(format!("resnet-mpi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let snapshot = |policy: &str| {
        let path = dir.join(format!("{policy}.safetensors"));
        let out = Command::new(env!("CARGO_BIN_EXE_train-resnet"))
            .args([
                "--preset",
                "tiny",
                "--classes",
                "4",
                "--image-size",
                "32",
                "--batch",
                "2",
                "--steps",
                "2",
                "--ranks",
                "2",
            ])
            .args(["--policy", policy, "--save", path.to_str().unwrap()])
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
            .collect::<BTreeMap<_, _>>()
    };
    let off = snapshot("off");
    assert!(
        off.keys().any(|n| n.ends_with("running_mean")),
        "the snapshot holds the BatchNorm statistics"
    );
    for policy in ["sqrt", "before-downsample"] {
        assert!(
            snapshot(policy) == off,
            "{policy}: two-rank weights or statistics differ from two-rank off"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
