//! `--fused-path generic`: the fused ops take the device-generic route a GPU takes, forced on the
//! CPU. Every model has every op on that route: every policy's gradients still equal plain
//! candle's bit for bit, the records say which route made them, and the route is as lean as the
//! kernels in what it keeps and within a stated margin in what it holds at its peak.

mod common;
use common::{models_args, out_dir, records, smoke};

/// Bytes held above the step's base when forward ends: what the model keeps for backward.
fn kept_at_forward_end(r: &serde_json::Value) -> f64 {
    let events = r["timeline"].as_array().unwrap();
    let end = events.iter().rfind(|e| e["phase"] == "forward").expect("a forward event")["bytes"]
        .as_u64()
        .unwrap();
    (end - r["timeline_base_bytes"].as_u64().unwrap()) as f64
}

#[test]
fn the_generic_route_is_measured_and_as_lean_as_the_kernels() {
    let models = "gpt2,bert,resnet,unet3d";
    let (kernel, generic) = (out_dir("generic-kernel"), out_dir("generic-route"));
    smoke(&kernel, &models_args(models, "off,sqrt", &[]));
    smoke(&generic, &models_args(models, "off,sqrt", &["--fused-path", "generic"]));
    let (k, g) = (records(&kernel), records(&generic));
    assert_eq!(k.len(), 8);
    for (k, g) in k.iter().zip(&g) {
        let what = format!("{} {}", g["model"], g["policy"]);
        assert_eq!(g["fused_path"], "generic", "{what}");
        assert!(k.get("fused_path").is_none(), "{what}: the kernel route's record names no route");
        assert_eq!(g["grads_bit_identical"], true, "{what}");
        assert_eq!(g["params_without_grad"], 0, "{what}");
        let step = g["step_peak_bytes"].as_f64().unwrap() / k["step_peak_bytes"].as_f64().unwrap();
        let kept = kept_at_forward_end(g) / kept_at_forward_end(k);
        eprintln!(
            "{what}: step peak {step:.3}x the kernels', kept at the end of forward {kept:.3}x"
        );
        // Each generic op records its composition as one op over its operands, so it keeps what
        // its kernel keeps (its operands and output); a composition that entered candle's graph
        // would keep its intermediates, several times as much. 5 %: the tensors are the same, the
        // allocator's rounding of them not quite.
        assert!(kept <= 1.05, "{what}: the generic route keeps {kept:.3}x what the kernels keep");
        // At its peak the generic route also holds its compositions' temporaries. Ours (norms,
        // attention, cross-entropy) stay within 25 % of the kernels'. A convolution composed of
        // candle's conv2d builds the column matrix of at least one whole image or depth slice
        // (9 or 27 times its input; in backward for its input's gradient and its weight's), which
        // no chunking of ours divides, while the kernels' blocks go down to one output row: at a
        // few images of a few pixels, as here, those temporaries are of the activations' size,
        // so a model with convolutions may hold up to twice the kernels' peak. (The bounds are
        // upper ones only: the kernels' workspaces scale with their problem, `Conv3dShape::sized`,
        // so neither route has a floor below the other.)
        let convolutional =
            ["resnet", "unet3d"].iter().any(|m| g["model"].as_str().unwrap().starts_with(m));
        let margin = if convolutional { 2.0 } else { 1.25 };
        assert!(
            step <= margin,
            "{what}: the generic route's step peak is {step:.3}x the kernels' (at most {margin}x)"
        );
    }
    std::fs::remove_dir_all(&kernel).unwrap();
    std::fs::remove_dir_all(&generic).unwrap();
}
