//! `bench-harness kernels`: the convolutions of a model recorded from its forward pass and each
//! one timed; without PyTorch, ours alone, said so.

mod common;

/// The small U-Net's 18 convolutions (two per level and the head, the up-convolutions, the
/// decoder's concatenating ones), each timed forward and backward; the first one's input is the
/// volume, whose gradient no model needs. A name outside the profile is refused with the names.
#[test]
fn every_convolution_of_a_model_is_recorded_and_timed() {
    let dir = common::out_dir("kernels");
    let out = common::harness(&[
        "kernels",
        "--models",
        "unet3d-small",
        "--rounds",
        "1",
        "--reps",
        "1",
        "--python",
        "/nonexistent/python",
        "--out",
        dir.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("no PyTorch beside ours"), "{err}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("convs.json")).unwrap()).unwrap();
    let convs = json["convolutions"].as_array().unwrap();
    assert_eq!(convs.len(), 18, "{convs:?}");
    assert_eq!(convs[0]["input_gradient"], false, "the volume needs no gradient");
    for c in convs {
        let ours = &c["ours"];
        assert!(
            ours["forward_ms"].as_f64().unwrap() > 0.0
                && ours["weight_grad_ms"].as_f64().unwrap() > 0.0
                && c["torch"].is_null(),
            "{c}"
        );
    }
    let kinds = |k: &str| convs.iter().filter(|c| c["kind"] == k).count();
    assert_eq!((kinds("conv3d-concat"), kinds("conv-transpose3d-k2s2")), (3, 3));
    let md = std::fs::read_to_string(dir.join("convs.md")).unwrap();
    assert!(md.contains("| unet3d-small | 18 |"), "{md}");
    std::fs::remove_dir_all(&dir).unwrap();

    let out = common::harness(&["kernels", "--models", "unet3d-big"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("resnet50, resnet152"), "{err}");
}
