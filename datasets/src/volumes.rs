//! 3D volumes for segmentation: synthetic shapes, and `.npy` files.

use crate::SplitMix;
use std::path::{Path, PathBuf};

/// Labels of the synthetic volumes.
pub const BACKGROUND: u32 = 0;
pub const SPHERE: u32 = 1;
pub const CUBE: u32 = 2;

/// One-channel volumes of `size^3` voxels holding one to three spheres and cubes of equal
/// brightness in noise; each voxel is labelled background, sphere or cube. Telling spheres from
/// cubes needs the shape, not the intensity, so a segmentation net has something to learn.
#[derive(Clone, Debug)]
pub struct SyntheticVolumes {
    pub size: usize,
    seed: u64,
}

impl SyntheticVolumes {
    pub fn new(size: usize, seed: u64) -> Self {
        SyntheticVolumes { size, seed }
    }

    /// The batch of `step`: voxels as (N, 1, S, S, S) and labels as (N, S, S, S), flattened.
    pub fn batch(&self, step: u64, n: usize) -> (Vec<f32>, Vec<u32>) {
        let mut rng = SplitMix::new(self.seed ^ step.wrapping_mul(0x9FB2_1C65_1E98_DF25));
        let s = self.size;
        let mut voxels = Vec::with_capacity(n * s * s * s);
        let mut labels = Vec::with_capacity(n * s * s * s);
        for _ in 0..n {
            let mut label = vec![BACKGROUND; s * s * s];
            for _ in 0..1 + rng.below(3) {
                let kind = if rng.below(2) == 0 { SPHERE } else { CUBE };
                let r = (s as f32 / 8.0).max(1.0) + rng.below((s / 8).max(1)) as f32;
                let c: Vec<f32> = (0..3)
                    .map(|_| r + rng.below((s as f32 - 2.0 * r).max(1.0) as usize) as f32)
                    .collect();
                for (i, l) in label.iter_mut().enumerate() {
                    let p = [
                        (i / (s * s)) as f32 - c[0],
                        ((i / s) % s) as f32 - c[1],
                        (i % s) as f32 - c[2],
                    ];
                    let inside = match kind {
                        SPHERE => p.iter().map(|v| v * v).sum::<f32>() <= r * r,
                        _ => p.iter().all(|v| v.abs() <= r * 0.8),
                    };
                    if inside {
                        *l = kind;
                    }
                }
            }
            for &l in &label {
                let noise = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                voxels.push(if l == BACKGROUND { 0.0 } else { 1.0 } + 0.6 * noise);
            }
            labels.extend(label);
        }
        (voxels, labels)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("volume folder {path}: {why}")]
    Folder { path: String, why: String },
    #[error("{path}: {why}")]
    File { path: String, why: String },
}

/// Volumes stored as NumPy arrays: `root/images/<name>.npy` (C, D, H, W) of f32 or f64 and
/// `root/labels/<name>.npy` (D, H, W) of integers, paired by name.
#[derive(Debug)]
pub struct NpyVolumes {
    pairs: Vec<(PathBuf, PathBuf)>,
    seed: u64,
}

/// A volume read from disk: its shape and values.
#[derive(Debug)]
pub struct Volume {
    pub shape: Vec<usize>,
    pub voxels: Vec<f32>,
    pub labels: Vec<u32>,
}

/// The files a volume folder at `root` holds, as [`NpyVolumes::open`] reads them: each
/// `images/*.npy` and the `labels/` file of its name, where there is one.
pub fn listed(root: &Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(root.join("images"))? {
        let path = entry?.path();
        let label = root.join("labels").join(path.file_name().unwrap_or_default());
        if path.extension().is_some_and(|e| e == "npy") {
            files.push(path);
            files.extend(Some(label).filter(|l| l.exists()));
        }
    }
    files.sort();
    Ok(files)
}

impl NpyVolumes {
    pub fn open(root: &Path, seed: u64) -> Result<Self, VolumeError> {
        let folder = |why: String| VolumeError::Folder { path: root.display().to_string(), why };
        let images =
            std::fs::read_dir(root.join("images")).map_err(|e| folder(format!("images/: {e}")))?;
        let mut pairs = Vec::new();
        for entry in images.filter_map(|e| e.ok()) {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "npy") {
                let label = root.join("labels").join(entry.file_name());
                if !label.exists() {
                    return Err(folder(format!(
                        "{} has no labels/{}",
                        path.display(),
                        entry.file_name().to_string_lossy()
                    )));
                }
                pairs.push((path, label));
            }
        }
        if pairs.is_empty() {
            return Err(folder("no images/*.npy".into()));
        }
        pairs.sort();
        Ok(NpyVolumes { pairs, seed })
    }

    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Reads volume `i`.
    pub fn read(&self, i: usize) -> Result<Volume, VolumeError> {
        let (image, label) = &self.pairs[i];
        let (shape, voxels) = read_npy(image, |n| n.into_f32())?;
        let (label_shape, labels) = read_npy(label, |n| n.into_u32())?;
        if shape.len() != 4 || label_shape != shape[1..] {
            let why = format!(
                "image shape {shape:?} (C, D, H, W) does not match label shape \
                {label_shape:?} (D, H, W)"
            );
            return Err(VolumeError::File { path: image.display().to_string(), why });
        }
        Ok(Volume { shape, voxels, labels })
    }

    /// Reads every label file and fails naming the first that holds a label outside
    /// `0..classes`: found when a batch drew it, it would stop the run steps late.
    pub fn check_labels(&self, classes: u32) -> Result<(), VolumeError> {
        for (_, label) in &self.pairs {
            let (_, labels) = read_npy(label, Numbers::into_u32)?;
            if let Some(&bad) = labels.iter().find(|&&l| l >= classes) {
                let why = format!("label {bad} is outside the {classes} classes (--classes)");
                return Err(VolumeError::File { path: label.display().to_string(), why });
            }
        }
        Ok(())
    }

    /// Which volumes batch `step` of `n` holds.
    fn picks(&self, step: u64, n: usize) -> Vec<usize> {
        let mut rng = SplitMix::new(self.seed ^ step.wrapping_mul(0xC2B2_AE3D_27D4_EB4F));
        (0..n).map(|_| rng.below(self.pairs.len())).collect()
    }

    /// The image files of batch `step` of `n`, in batch order: what an error about the batch names.
    pub fn files(&self, step: u64, n: usize) -> Vec<String> {
        self.picks(step, n).into_iter().map(|i| self.pairs[i].0.display().to_string()).collect()
    }

    /// `n` random volumes of `step`, which must all have the same shape: (shape, voxels, labels).
    pub fn batch(&self, step: u64, n: usize) -> Result<VolumeBatch, VolumeError> {
        let (mut shape, mut voxels, mut labels) = (None, Vec::new(), Vec::new());
        for i in self.picks(step, n) {
            let v = self.read(i)?;
            if shape.get_or_insert(v.shape.clone()) != &v.shape {
                let why = format!("shape {:?} differs from the batch's {:?}", v.shape, shape);
                return Err(VolumeError::File { path: self.pairs[i].0.display().to_string(), why });
            }
            voxels.extend(v.voxels);
            labels.extend(v.labels);
        }
        Ok((shape.unwrap_or_default(), voxels, labels))
    }
}

/// A batch of volumes: the shape of one (C, D, H, W), the voxels and the labels, concatenated.
pub type VolumeBatch = (Vec<usize>, Vec<f32>, Vec<u32>);

/// Numbers of any NumPy dtype we accept, converted on read.
enum Numbers {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I64(Vec<i64>),
    U8(Vec<u8>),
    I32(Vec<i32>),
}

impl Numbers {
    /// An image's voxels: f4 or f8.
    fn into_f32(self) -> Result<Vec<f32>, String> {
        match self {
            Numbers::F32(v) => Ok(v),
            Numbers::F64(v) => Ok(v.into_iter().map(|x| x as f32).collect()),
            _ => Err("an image's dtype must be f4 or f8".into()),
        }
    }

    /// A label volume's class indices: integers (i8, i4, u1), none negative.
    fn into_u32(self) -> Result<Vec<u32>, String> {
        let indices = |v: Vec<i64>| {
            v.into_iter()
                .map(|x| {
                    u32::try_from(x).map_err(|_| {
                        format!("label {x} is negative: labels are class indices from 0")
                    })
                })
                .collect()
        };
        match self {
            Numbers::I64(v) => indices(v),
            Numbers::I32(v) => indices(v.into_iter().map(i64::from).collect()),
            Numbers::U8(v) => Ok(v.into_iter().map(u32::from).collect()),
            _ => Err("a label volume's dtype must be an integer one: i8, i4 or u1".into()),
        }
    }
}

fn read_npy<T>(
    path: &Path,
    convert: impl Fn(Numbers) -> Result<Vec<T>, String>,
) -> Result<(Vec<usize>, Vec<T>), VolumeError> {
    let err = |why: String| VolumeError::File { path: path.display().to_string(), why };
    let bytes = std::fs::read(path).map_err(|e| err(e.to_string()))?;
    let npy = npyz::NpyFile::new(&bytes[..]).map_err(|e| err(e.to_string()))?;
    let shape: Vec<usize> = npy.shape().iter().map(|&d| d as usize).collect();
    if npy.order() != npyz::Order::C {
        return Err(err("Fortran-ordered arrays are not supported; save with C order".into()));
    }
    let descr = npy.dtype().descr();
    let numbers = match descr.trim_matches('\'').trim_start_matches(['<', '|', '=']) {
        "f4" => Numbers::F32(npy.into_vec().map_err(|e| err(e.to_string()))?),
        "f8" => Numbers::F64(npy.into_vec().map_err(|e| err(e.to_string()))?),
        "i8" => Numbers::I64(npy.into_vec().map_err(|e| err(e.to_string()))?),
        "i4" => Numbers::I32(npy.into_vec().map_err(|e| err(e.to_string()))?),
        "u1" => Numbers::U8(npy.into_vec().map_err(|e| err(e.to_string()))?),
        other => return Err(err(format!("unsupported dtype `{other}`"))),
    };
    let values = convert(numbers).map_err(|why| err(format!("{why} (dtype `{descr}`)")))?;
    Ok((shape, values))
}

#[cfg(test)]
mod tests {
    use super::*;
    use npyz::WriterBuilder;

    #[test]
    fn synthetic_volumes_hold_both_shapes() {
        let d = SyntheticVolumes::new(16, 1);
        let (x, y) = d.batch(0, 4);
        assert_eq!((x.len(), y.len()), (4 * 4096, 4 * 4096));
        assert_eq!(d.batch(0, 4), (x.clone(), y.clone()));
        for label in [BACKGROUND, SPHERE, CUBE] {
            assert!(y.contains(&label), "label {label} missing");
        }
        let mean = |l: u32| {
            let v: Vec<f32> = x.iter().zip(&y).filter(|(_, &t)| t == l).map(|(v, _)| *v).collect();
            v.iter().sum::<f32>() / v.len() as f32
        };
        assert!((mean(SPHERE) - mean(CUBE)).abs() < 0.1, "shapes must not differ in brightness");
        assert!(mean(SPHERE) > mean(BACKGROUND) + 0.8);
    }

    #[test]
    fn npy_folder_round_trip_and_errors() {
        let root = std::env::temp_dir().join(format!("npy-volumes-{}", std::process::id()));
        std::fs::create_dir_all(root.join("images")).unwrap();
        std::fs::create_dir_all(root.join("labels")).unwrap();
        let write = |path: PathBuf, shape: &[u64], data: Vec<f32>| {
            let mut out = Vec::new();
            let mut w = npyz::WriteOptions::new()
                .default_dtype()
                .shape(shape)
                .writer(&mut out)
                .begin_nd()
                .unwrap();
            w.extend(data).unwrap();
            w.finish().unwrap();
            std::fs::write(path, out).unwrap();
        };
        write(root.join("images/a.npy"), &[1, 2, 2, 2], (0..8).map(|i| i as f32).collect());
        let mut out = Vec::new();
        let mut w = npyz::WriteOptions::new()
            .default_dtype()
            .shape(&[2, 2, 2])
            .writer(&mut out)
            .begin_nd()
            .unwrap();
        w.extend((0..8i64).map(|i| i % 3)).unwrap();
        w.finish().unwrap();
        std::fs::write(root.join("labels/a.npy"), out).unwrap();
        let v = NpyVolumes::open(&root, 0).unwrap();
        let vol = v.read(0).unwrap();
        assert_eq!(vol.shape, [1, 2, 2, 2]);
        assert_eq!(vol.voxels[7], 7.0);
        assert_eq!(vol.labels, [0, 1, 2, 0, 1, 2, 0, 1]);
        write(root.join("images/b.npy"), &[1, 2, 2, 2], vec![0.0; 8]);
        assert!(NpyVolumes::open(&root, 0)
            .unwrap_err()
            .to_string()
            .contains("has no labels/b.npy"));
        write(root.join("labels/b.npy"), &[2, 2, 2], vec![0.5; 8]);
        let err = NpyVolumes::open(&root, 0).unwrap().read(1).unwrap_err().to_string();
        assert!(err.contains("dtype must be an integer one"), "{err}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
