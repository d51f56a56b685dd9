//! `--fused-path generic`: the fused ops take the device-generic route a GPU takes, forced on the
//! CPU. GPT-2 and BERT have every op on that route: their activation peaks stay near the kernels'
//! (measured 1.003-1.058x under `off`, 1.003x BERT and 1.097x GPT-2 under `sqrt`, where the
//! composed backward's temporaries set the peak) while every policy's gradients still equal plain
//! candle's bit for bit; the records say which route made them.

mod common;
use common::{out_dir, records, smoke};

#[test]
fn the_generic_route_is_measured_and_as_lean_as_the_kernels() {
    let args = ["--matrix", "models", "--models", "gpt2,bert", "--policies", "off,sqrt", "--rounds", "0"];
    let (kernel, generic) = (out_dir("generic-kernel"), out_dir("generic-route"));
    smoke(&kernel, &args);
    smoke(&generic, &[&args[..], &["--fused-path", "generic"]].concat());
    let (k, g) = (records(&kernel), records(&generic));
    assert_eq!(k.len(), 4);
    for (k, g) in k.iter().zip(&g) {
        let what = format!("{} {}", g["model"], g["policy"]);
        assert_eq!(g["fused_path"], "generic", "{what}");
        assert!(k.get("fused_path").is_none(), "{what}: the kernel route's record names no route");
        assert_eq!(g["grads_bit_identical"], true, "{what}");
        assert_eq!(g["params_without_grad"], 0, "{what}");
        let ratio = g["activation_peak_bytes"].as_f64().unwrap() / k["activation_peak_bytes"].as_f64().unwrap();
        eprintln!("{what}: activation peak {ratio:.3}x the kernels'");
        assert!((0.9..=1.15).contains(&ratio), "{what}: the generic route's activation peak is {ratio:.3}x the kernels'");
    }
    std::fs::remove_dir_all(&kernel).unwrap();
    std::fs::remove_dir_all(&generic).unwrap();
}
