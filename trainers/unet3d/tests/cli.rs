//! The trainer's command line under bad input (each test says what would go wrong unchecked).

use std::process::Command;

fn fails_saying(args: &[&str], needle: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_train-unet3d"))
        .args(["--preset", "tiny", "--volume", "8", "--steps", "1"])
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && !err.contains("panicked") && err.contains(needle),
        "{args:?}: {err}"
    );
}

/// `--group-norm` with more groups than channels is refused (clamped silently, it would train
/// another model than the one asked for), and `--classes 0` names the flag (unchecked, it would
/// fail deep inside with `empty tensor for reduce`).
#[test]
fn impossible_groups_and_classes_are_refused() {
    fails_saying(&["--group-norm", "1000"], "GroupNorm groups do not divide");
    fails_saying(&["--classes", "0"], "--classes must be at least 2");
    // One class trained at loss 0.
    fails_saying(&["--classes", "1"], "--classes must be at least 2");
    // Near 2^64, the synthetic labels' allocation overflowed: `capacity overflow`.
    fails_saying(&["--classes", "18446744073709551615"], "is more than 1099511627776");
}

/// A `.npy` file (NumPy format 1.0) of `descr` values with `shape`.
fn write_npy(path: &std::path::Path, descr: &str, shape: &[usize], data: &[u8]) {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let mut header = format!(
        "{{'descr': '{descr}', 'fortran_order': False, 'shape': ({},), }}",
        dims.join(", ")
    );
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend((header.len() as u16).to_le_bytes());
    bytes.extend(header.as_bytes());
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

/// One NaN voxel in the data stops the run at the first step, before the update, naming the
/// step and the file; nothing is saved. A fused BatchNorm + ReLU that turned the NaN into 0 would
/// let the run train at a finite loss near ln 3, exit 0 and save NaN weights and statistics.
#[test]
fn a_nan_voxel_stops_the_run_naming_its_file() {
    let dir = std::env::temp_dir().join(format!("unet3d-nan-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for sub in ["images", "labels"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    let mut voxels: Vec<f32> = (0..512).map(|i| (i % 7) as f32 / 7.0).collect();
    voxels[100] = f32::NAN;
    let image = dir.join("images/scan.npy");
    write_npy(
        &image,
        "<f4",
        &[1, 8, 8, 8],
        &voxels.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>(),
    );
    write_npy(
        &dir.join("labels/scan.npy"),
        "|u1",
        &[8, 8, 8],
        &(0..512).map(|i| (i % 3) as u8).collect::<Vec<u8>>(),
    );
    let save = dir.join("w.safetensors");
    // In f16 too, whose loss scaler skipped the step as an overflow and named no file.
    for dtype in ["f32", "f16"] {
        let out = Command::new(env!("CARGO_BIN_EXE_train-unet3d"))
            .args(["--preset", "tiny", "--volume", "8", "--batch", "2", "--steps", "3"])
            .args(["--dtype", dtype, "--data", dir.to_str().unwrap()])
            .args(["--save", save.to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && err.contains("step 0: the data holds a NaN or an infinity")
                && err.contains(image.to_str().unwrap()),
            "{dtype}: {err}"
        );
        assert!(!save.exists(), "a snapshot was saved");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Labels are checked when the data is opened, naming the file: a label beyond `--classes`
/// stopped the run only when a batch drew it (six steps late), naming neither file nor batch, and
/// a label of -1 was refused with a message that listed its dtype as valid.
#[test]
fn labels_out_of_range_are_refused_naming_the_file() {
    let dir = std::env::temp_dir().join(format!("unet3d-labels-{}", std::process::id()));
    let minus_one: Vec<u8> = (0..512).flat_map(|_| (-1i32).to_le_bytes()).collect();
    for (descr, labels, said) in [
        ("|u1", vec![8u8; 512], "label 8 is outside the 3 classes"),
        ("<i4", minus_one, "label -1 is negative"),
    ] {
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["images", "labels"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        let voxels: Vec<u8> = (0..512).flat_map(|i| (i as f32 / 512.0).to_le_bytes()).collect();
        write_npy(&dir.join("images/scan.npy"), "<f4", &[1, 8, 8, 8], &voxels);
        let labels_file = dir.join("labels/scan.npy");
        write_npy(&labels_file, descr, &[8, 8, 8], &labels);
        fails_saying(&["--data", dir.to_str().unwrap(), "--batch", "1"], said);
        fails_saying(
            &["--data", dir.to_str().unwrap(), "--batch", "1"],
            labels_file.to_str().unwrap(),
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A resume with another `--loss` names both values as the flag spells them (`ce-dice`): the
/// configuration used to be compared in the enum's own spelling, "--loss is cedice".
#[test]
fn a_resume_with_another_loss_names_it_as_the_flag_spells_it() {
    let dir = std::env::temp_dir().join(format!("unet3d-cli-loss-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let save = dir.join("w.safetensors");
    let out = Command::new(env!("CARGO_BIN_EXE_train-unet3d"))
        .args(["--preset", "tiny", "--volume", "8", "--steps", "1", "--loss", "ce-dice"])
        .args(["--save-every", "1", "--save", save.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let snapshot = dir.join("w.train.safetensors");
    let resume = ["--resume", snapshot.to_str().unwrap(), "--loss", "ce"];
    fails_saying(&resume, "--loss is ce in this run but was ce-dice");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A batch at which the BatchNorm at the bottom of the U sees one value per channel (one
/// 4-voxel volume through two poolings: 1x1x1) is refused naming `--batch`, as PyTorch refuses
/// it; GroupNorm, which normalizes each sample on its own, takes it.
#[test]
fn a_batch_norm_of_one_value_per_channel_is_refused() {
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_train-unet3d"))
            .args(["--preset", "tiny", "--volume", "4", "--batch", "1", "--steps", "1"])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--batch 1 is too small for BatchNorm"), "{err}");
    let out = run(&["--group-norm", "2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// Every file `train-unet3d` reads is spared by every output it writes: the training snapshot,
/// and a volume and its labels in the `--data` folder.
#[test]
fn every_file_read_is_spared_by_every_output() {
    use testkit::cli::{assert_outputs_spare_inputs, ReadFile};
    let bin = env!("CARGO_BIN_EXE_train-unet3d");
    let dir = std::env::temp_dir().join(format!("unet3d-spared-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for sub in ["data/images", "data/labels"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    let voxels: Vec<u8> = (0..512).flat_map(|i| ((i % 7) as f32 / 7.0).to_le_bytes()).collect();
    write_npy(&dir.join("data/images/scan.npy"), "<f4", &[1, 8, 8, 8], &voxels);
    let labels: Vec<u8> = (0..512).map(|i| (i % 3) as u8).collect();
    write_npy(&dir.join("data/labels/scan.npy"), "|u1", &[8, 8, 8], &labels);
    let at = |name: &str| dir.join(name);
    let s = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let (w, train_w, data) = (s("w.safetensors"), s("w.train.safetensors"), s("data"));
    let tiny = ["--preset", "tiny", "--volume", "8", "--steps", "1"];
    let out = Command::new(bin).args(tiny).args(["--save", &w]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (all, log) = (&["--save", "--log-json"][..], &["--log-json"][..]);
    let reads = [
        ReadFile::new(&["--resume", &train_w], &at("w.train.safetensors"), log),
        ReadFile::new(&["--data", &data], &at("data/images/scan.npy"), all),
        ReadFile::new(&["--data", &data], &at("data/labels/scan.npy"), all),
    ];
    assert_outputs_spare_inputs(bin, &tiny, &reads);
    std::fs::remove_dir_all(&dir).unwrap();
}
