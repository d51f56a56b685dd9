//! The `train-resnet` binary learns on its default data and rejects bad input clearly.

use std::process::Command;

fn run(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_train-resnet")).args(args).output().unwrap()
}

#[test]
fn loss_falls_on_synthetic_images() {
    // In f32, with bf16 and f16 activations (f16 under loss scaling) and with bf16 weights.
    // At batch 32 and learning rate 0.02 the loss falls smoothly in every dtype and with every
    // seed tried. At batch 16 and the default 0.05 single batches spiked (losses of 4 and 7
    // among losses of 0.01, f32 too), so where the spikes fell moved with the last rounding bit
    // of a machine's kernels, and with them any statistic of the last steps.
    for dtype in ["f32", "bf16", "f16", "bf16-weights"] {
        let args = [
            "--preset",
            "tiny",
            "--steps",
            "30",
            "--batch",
            "32",
            "--lr",
            "0.02",
            "--image-size",
            "32",
            "--classes",
            "4",
            "--dtype",
            dtype,
        ];
        let (losses, _) = testkit::run_logged(env!("CARGO_BIN_EXE_train-resnet"), &args);
        let mut start = losses[..5].to_vec();
        start.sort_by(f32::total_cmp);
        // The model learns (the first steps are near chance, ln 4 = 1.39) and stays learnt: each
        // of the last ten losses is below 0.6x the median of the first five. A spiking run fails.
        let (first, worst) = (start[2], losses[20..].iter().copied().fold(f32::MIN, f32::max));
        assert!(
            worst < 0.6 * first,
            "{dtype}: loss went {first:.3} -> at worst {worst:.3} in the last ten steps: {losses:?}"
        );
    }
}

#[test]
fn bad_input_gives_clear_errors() {
    for (args, needle) in [
        (vec!["--preset", "resnet51"], "valid presets: tiny, resnet18"),
        (vec!["--preset", "tiny", "--policy", "every-other"], "valid policies"),
        (vec!["--preset", "tiny", "--image-size", "16"], "at least 32"),
        (
            vec!["--preset", "tiny", "--data", "/nonexistent/folder"],
            "--data /nonexistent/folder: No such file",
        ),
        // One class trained at loss 0.
        (vec!["--preset", "tiny", "--classes", "1"], "--classes must be at least 2"),
    ] {
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && !err.contains("panicked") && err.contains(needle),
            "{args:?}: {err}"
        );
    }
}

/// An image folder of one class trained at loss 0, and an empty class folder was dropped
/// silently, changing the class count: one class is refused as `--classes 1` is, and an empty
/// class folder is named.
#[test]
fn a_data_folder_needs_two_classes_each_with_images() {
    let root = std::env::temp_dir().join(format!("resnet-one-class-{}", std::process::id()));
    std::fs::create_dir_all(root.join("cats")).unwrap();
    image::RgbImage::from_pixel(40, 40, image::Rgb([255u8, 0, 0]))
        .save(root.join("cats").join("0.png"))
        .unwrap();
    std::fs::create_dir_all(root.join("dogs")).unwrap();
    let data = root.to_str().unwrap();
    for needle in ["dogs has no images", "1 class folder; training needs at least 2"] {
        let out = run(&["--preset", "tiny", "--data", data, "--steps", "1", "--batch", "1"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(needle), "{needle}: {err}");
        let _ = std::fs::remove_dir(root.join("dogs"));
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// A damaged image is named before training: images were decoded as batches drew them, and a
/// corrupt PNG among 40 stopped the run at step 12, before its first snapshot.
#[test]
fn a_damaged_image_is_named_before_training() {
    let root = std::env::temp_dir().join(format!("resnet-damaged-{}", std::process::id()));
    for class in ["cats", "dogs"] {
        std::fs::create_dir_all(root.join(class)).unwrap();
        for i in 0..20 {
            image::RgbImage::from_pixel(8, 8, image::Rgb([i * 10, 0, 0]))
                .save(root.join(class).join(format!("{i}.png")))
                .unwrap();
        }
    }
    std::fs::write(root.join("dogs").join("7.png"), b"not a PNG at all").unwrap();
    let data = root.to_str().unwrap();
    let out = run(&["--preset", "tiny", "--image-size", "32", "--data", data, "--steps", "40"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("dogs/7.png"), "{err}");
    assert!(!err.contains("step    0"), "refused only after training began: {err}");
    std::fs::remove_dir_all(&root).unwrap();
}

/// An ImageNet snapshot has a 1000-class `fc`: `--init` into a model of another class count loads
/// the rest and initialises `fc`, saying so; `--strict` refuses the mismatch.
#[test]
fn init_with_another_class_count_initialises_the_classifier() {
    use trainable::Model;
    let dir = std::env::temp_dir().join(format!("resnet-init-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("imagenet.safetensors");
    let config = resnet::Config { classes: 1000, ..resnet::Preset::Tiny.config() };
    resnet::ResNet::new(config, &candle_core::Device::Cpu, 3)
        .unwrap()
        .save_snapshot(&path)
        .unwrap();

    let args = [
        "--preset",
        "tiny",
        "--classes",
        "4",
        "--image-size",
        "32",
        "--steps",
        "1",
        "--init",
        path.to_str().unwrap(),
    ];
    let out = run(&args);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success()
            && log.contains("fc.weight (shape [1000, 256] in the snapshot)")
            && log.contains("fc.bias (shape [1000]"),
        "{log}"
    );
    let out = run(&[&args[..], &["--strict"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--strict") && err.contains("expects [4"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A classifier too large for the machine is refused while it is built, with exit 1 and the flags
/// to change. Without the check, `--classes 100000000000` would abort at once (SIGABRT, "memory
/// allocation of ... bytes failed").
#[test]
fn a_model_too_large_for_the_machine_is_refused() {
    let out = run(&["--preset", "tiny", "--classes", "100000000000", "--steps", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("heap cap: refused")
            && err.contains("the model does not fit in this machine's available memory")
            && err.contains("--classes"),
        "{err}"
    );
}

/// `--classes` near 2^64 (also 2^63, 2^61) panicked with `capacity overflow` allocating the
/// synthetic labels: refused, naming the flag and its bound.
#[test]
fn classes_beyond_their_bound_are_refused() {
    for classes in ["18446744073709551615", "9223372036854775808", "2305843009213693952"] {
        let out = run(&["--preset", "tiny", "--steps", "1", "--classes", classes]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && !err.contains("panicked") && err.contains("is more than"),
            "--classes {classes}: {err}"
        );
    }
}

/// A batch at which the last BatchNorm sees one value per channel (`--batch 1` of 32-pixel
/// images: a 1x1 map) is refused naming `--batch`, as PyTorch refuses it: it trained a
/// degenerate model whose step-0 loss was ln 10 and whose classifier bias alone learned. Two
/// samples train.
#[test]
fn a_batch_norm_of_one_value_per_channel_is_refused() {
    let args = ["--preset", "tiny", "--image-size", "32", "--steps", "1", "--batch"];
    let out = run(&[&args[..], &["1"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err
                .contains("--batch 1 is too small for BatchNorm: the smallest feature map is 1x1"),
        "{err}"
    );
    let out = run(&[&args[..], &["2"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// Every file `train-resnet` reads is spared by every output it writes: weights, training
/// snapshot, and an image of its `--data` folder.
#[test]
fn every_file_read_is_spared_by_every_output() {
    use testkit::cli::{assert_outputs_spare_inputs, ReadFile};
    let bin = env!("CARGO_BIN_EXE_train-resnet");
    let dir = std::env::temp_dir().join(format!("resnet-spared-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for class in ["cats", "dogs"] {
        std::fs::create_dir_all(dir.join("data").join(class)).unwrap();
        image::RgbImage::from_pixel(8, 8, image::Rgb([200, 0, 0]))
            .save(dir.join("data").join(class).join("0.png"))
            .unwrap();
    }
    let at = |name: &str| dir.join(name);
    let s = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let (w, train_w, data) = (s("w.safetensors"), s("w.train.safetensors"), s("data"));
    let tiny = ["--preset", "tiny", "--image-size", "32", "--batch", "2", "--steps", "1"];
    let out = run(&[&tiny[..], &["--save", &w, "--save-every", "1"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (all, log) = (&["--save", "--log-json"][..], &["--log-json"][..]);
    let reads = [
        ReadFile::new(&["--init", &w], &at("w.safetensors"), log),
        ReadFile::new(&["--resume", &train_w], &at("w.train.safetensors"), log),
        ReadFile::new(&["--data", &data], &at("data/dogs/0.png"), all),
    ];
    assert_outputs_spare_inputs(bin, &tiny, &reads);
    std::fs::remove_dir_all(&dir).unwrap();
}
