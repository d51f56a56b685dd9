//! `--fused-path generic`: the fused ops take the device-generic route a GPU takes, forced on the
//! CPU. Every model has every op on that route: each step peak stays within 25 % of the kernels'
//! while every policy's gradients still equal plain candle's bit for bit; the records say which
//! route made them. Measured under `off` / `sqrt` (this test prints them): BERT 1.186x / 1.116x
//! and GPT-2 1.119x / 1.076x (BERT's peak is in the last stage's backward, the head, where the
//! kernels' cross-entropy keeps less than the composed one; before the vendored candle stopped
//! summing first gradients into zeros, vendor/README.md, both routes paid for those zeros there:
//! BERT 1.003x, GPT-2 1.057x); ResNet 1.024x / 0.878x and the U-Net 0.308x / 0.286x, the
//! kernel's operand blocks of up to 2^21 entries and its channels-last copy of a block's input
//! outweighing candle's per-slice columns at this size. (Before neither route computed the
//! gradient of an input no variable leads to, the image or volume at the first convolution,
//! ResNet was 0.873x / 0.710x and the U-Net 0.373x / 0.347x.)

mod common;
use common::{out_dir, records, smoke};

#[test]
fn the_generic_route_is_measured_and_as_lean_as_the_kernels() {
    let args = ["--matrix", "models", "--models", "gpt2,bert,resnet,unet3d", "--policies", "off,sqrt", "--rounds", "0"];
    let (kernel, generic) = (out_dir("generic-kernel"), out_dir("generic-route"));
    smoke(&kernel, &args);
    smoke(&generic, &[&args[..], &["--fused-path", "generic"]].concat());
    let (k, g) = (records(&kernel), records(&generic));
    assert_eq!(k.len(), 8);
    for (k, g) in k.iter().zip(&g) {
        let what = format!("{} {}", g["model"], g["policy"]);
        assert_eq!(g["fused_path"], "generic", "{what}");
        assert!(k.get("fused_path").is_none(), "{what}: the kernel route's record names no route");
        assert_eq!(g["grads_bit_identical"], true, "{what}");
        assert_eq!(g["params_without_grad"], 0, "{what}");
        let ratio = |field: &str| g[field].as_f64().unwrap() / k[field].as_f64().unwrap();
        let (step, activation) = (ratio("step_peak_bytes"), ratio("activation_peak_bytes"));
        eprintln!("{what}: step peak {step:.3}x the kernels', activation peak {activation:.3}x");
        assert!((0.25..=1.25).contains(&step), "{what}: the generic route's step peak is {step:.3}x the kernels'");
    }
    std::fs::remove_dir_all(&kernel).unwrap();
    std::fs::remove_dir_all(&generic).unwrap();
}
