//! The harness on two MPI ranks (`cargo test -p bench-harness --features mpi --test ranks`; needs
//! Open MPI's `mpirun`): every configuration runs on both, each record names the ranks, the
//! largest rank's peak and the all-reduce time, and the gradient check still holds.
#![cfg(feature = "mpi")]

mod common;
use common::{out_dir, records, smoke};

#[test]
fn the_smoke_matrix_runs_on_two_ranks() {
    let dir = out_dir("ranks");
    smoke(
        &dir,
        &[
            "--matrix",
            "models",
            "--models",
            "resnet-tiny,gpt2-tiny",
            "--policies",
            "off,sqrt",
            "--ranks",
            "2",
            "--rounds",
            "0",
        ],
    );
    let recs = records(&dir);
    assert_eq!(recs.len(), 4, "two models x two policies");
    for r in &recs {
        let what = format!("{} {}", r["model"], r["policy"]);
        assert_eq!(r["status"], "ok", "{what}: {}", r["error"]);
        assert_eq!(r["ranks"], 2, "{what}");
        assert_eq!(r["grads_bit_identical"], true, "{what}");
        assert!(
            r["step_peak_bytes_max_rank"].as_u64().unwrap()
                >= r["step_peak_bytes"].as_u64().unwrap(),
            "{what}"
        );
        assert!(r["all_reduce_ms"].as_f64().unwrap() > 0.0, "{what}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
