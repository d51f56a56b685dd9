//! Synthetic images with learnable class structure.

use crate::SplitMix;

/// Images of `classes` classes, `3 x size x size`: class k is a sinusoidal grating of its own
/// orientation, frequency and colour, at a random phase, plus uniform noise. A convnet separates
/// the classes within a few hundred steps; chance is `1 / classes`.
#[derive(Clone, Debug)]
pub struct SyntheticImages {
    pub classes: usize,
    pub size: usize,
    seed: u64,
}

impl SyntheticImages {
    pub fn new(classes: usize, size: usize, seed: u64) -> Self {
        SyntheticImages { classes: classes.max(1), size, seed }
    }

    /// The batch of `step`: `n` images flattened row-major as (N, 3, size, size), and labels.
    pub fn batch(&self, step: u64, n: usize) -> (Vec<f32>, Vec<u32>) {
        let mut rng = SplitMix::new(self.seed ^ step.wrapping_mul(0xA076_1D64_78BD_642F));
        let s = self.size;
        let mut pixels = Vec::with_capacity(n * 3 * s * s);
        let mut labels = Vec::with_capacity(n);
        for _ in 0..n {
            let k = rng.below(self.classes);
            labels.push(k as u32);
            let frac = k as f32 / self.classes as f32;
            let theta = std::f32::consts::PI * frac;
            let freq = (2 + k % 3) as f32 * std::f32::consts::TAU / s as f32;
            let phase = (rng.next_u64() % 1000) as f32 / 1000.0 * std::f32::consts::TAU;
            let (c, sn) = (theta.cos(), theta.sin());
            for ch in 0..3 {
                let colour = 0.5 + 0.5 * (std::f32::consts::TAU * (frac + ch as f32 / 3.0)).cos();
                for y in 0..s {
                    for x in 0..s {
                        let wave = (freq * (x as f32 * c + y as f32 * sn) + phase).sin();
                        let noise = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                        pixels.push(colour * wave + 0.5 * noise);
                    }
                }
            }
        }
        (pixels, labels)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_with_all_classes() {
        let d = SyntheticImages::new(4, 8, 1);
        let (x, y) = d.batch(3, 64);
        assert_eq!(x.len(), 64 * 3 * 64);
        assert_eq!(d.batch(3, 64), (x.clone(), y.clone()));
        assert_ne!(d.batch(4, 64).0, x);
        assert!((0..4).all(|k| y.contains(&k)));
        assert!(x.iter().all(|v| v.abs() <= 1.25));
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FolderError {
    #[error("image folder {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error(
        "image folder {path} has no class sub-folders with images (expected \
        root/<class>/<image>.png|jpg)"
    )]
    Empty { path: String },
    #[error(
        "class folder {path} has no images (.png, .jpg, .jpeg): a class without examples would \
        change the class count; remove it or add its images"
    )]
    EmptyClass { path: String },
    #[error("image {path}: {source}")]
    Decode { path: String, source: image::ImageError },
}

/// A folder of images by class (torchvision's ImageFolder layout: `root/<class>/<file>`), read as
/// RGB, resized to `size x size` and normalised with the ImageNet mean and deviation.
#[derive(Debug)]
pub struct ImageFolder {
    classes: Vec<String>,
    files: Vec<(std::path::PathBuf, u32)>,
    size: usize,
    seed: u64,
}

const MEAN: [f32; 3] = [0.485, 0.456, 0.406];
const STD: [f32; 3] = [0.229, 0.224, 0.225];

/// The images an image folder at `root` holds, as [`ImageFolder::open`] reads them: the files
/// with an image extension in each of its sub-folders.
pub fn listed(root: &std::path::Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    Ok(class_folders(root)?.into_iter().flat_map(|(_, images)| images).collect())
}

/// Each sub-folder of `root` (a class), in name order, with its image files in name order.
#[allow(clippy::type_complexity)]
fn class_folders(
    root: &std::path::Path,
) -> std::io::Result<Vec<(std::path::PathBuf, Vec<std::path::PathBuf>)>> {
    let entries = |dir: &std::path::Path| -> std::io::Result<Vec<std::path::PathBuf>> {
        let mut paths: Vec<_> =
            std::fs::read_dir(dir)?.filter_map(|e| Some(e.ok()?.path())).collect();
        paths.sort();
        Ok(paths)
    };
    let image = |p: &std::path::PathBuf| {
        p.extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| ["png", "jpg", "jpeg"].contains(&e.to_ascii_lowercase().as_str()))
    };
    let dirs = entries(root)?.into_iter().filter(|p| p.is_dir());
    dirs.map(|dir| Ok((dir.clone(), entries(&dir)?.into_iter().filter(image).collect()))).collect()
}

impl ImageFolder {
    pub fn open(root: &std::path::Path, size: usize, seed: u64) -> Result<Self, FolderError> {
        let io = |source| FolderError::Io { path: root.display().to_string(), source };
        let (mut classes, mut files) = (Vec::new(), Vec::new());
        for (dir, images) in class_folders(root).map_err(io)? {
            if images.is_empty() {
                return Err(FolderError::EmptyClass { path: dir.display().to_string() });
            }
            let label = classes.len() as u32;
            classes.push(
                dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            );
            files.extend(images.into_iter().map(|p| (p, label)));
        }
        if files.is_empty() {
            return Err(FolderError::Empty { path: root.display().to_string() });
        }
        // Every image's header now, not its first draw: a damaged file among thousands stopped
        // the run at whichever step drew it, before the first snapshot. (Decoding them all
        // would read the whole data set before the first step.)
        for (path, _) in &files {
            let decode = |source| FolderError::Decode { path: path.display().to_string(), source };
            let reader = image::ImageReader::open(path)
                .and_then(|r| r.with_guessed_format())
                .map_err(|e| decode(image::ImageError::IoError(e)))?;
            reader.into_dimensions().map_err(decode)?;
        }
        Ok(ImageFolder { classes, files, size, seed })
    }

    /// How many images it holds.
    pub fn images(&self) -> usize {
        self.files.len()
    }

    pub fn classes(&self) -> &[String] {
        &self.classes
    }

    /// `n` random images of `step` as (N, 3, size, size) and their labels.
    pub fn batch(&self, step: u64, n: usize) -> Result<(Vec<f32>, Vec<u32>), FolderError> {
        let mut rng = SplitMix::new(self.seed ^ step.wrapping_mul(0xE703_7ED1_A0B4_28DB));
        let s = self.size as u32;
        let mut pixels = Vec::with_capacity(n * 3 * (s * s) as usize);
        let mut labels = Vec::with_capacity(n);
        for _ in 0..n {
            let (path, label) = &self.files[rng.below(self.files.len())];
            let img = image::open(path).map_err(|source| FolderError::Decode {
                path: path.display().to_string(),
                source,
            })?;
            let rgb = image::imageops::resize(
                &img.to_rgb8(),
                s,
                s,
                image::imageops::FilterType::Triangle,
            );
            for ch in 0..3 {
                pixels.extend(rgb.pixels().map(|p| (p[ch] as f32 / 255.0 - MEAN[ch]) / STD[ch]));
            }
            labels.push(*label);
        }
        Ok((pixels, labels))
    }
}

#[cfg(test)]
mod folder_tests {
    use super::*;

    #[test]
    fn reads_classes_and_images() {
        let root = std::env::temp_dir().join(format!("imagefolder-{}", std::process::id()));
        for (class, colour) in [("cats", [255u8, 0, 0]), ("dogs", [0, 0, 255])] {
            std::fs::create_dir_all(root.join(class)).unwrap();
            for i in 0..2 {
                image::RgbImage::from_pixel(10, 7, image::Rgb(colour))
                    .save(root.join(class).join(format!("{i}.png")))
                    .unwrap();
            }
        }
        std::fs::create_dir_all(root.join("empty")).unwrap();
        let err = ImageFolder::open(&root, 4, 0).unwrap_err().to_string();
        assert!(err.contains("empty") && err.contains("has no images"), "{err}");
        assert!(ImageFolder::open(&root.join("empty"), 4, 0)
            .unwrap_err()
            .to_string()
            .contains("no class sub-folders"));
        std::fs::remove_dir(root.join("empty")).unwrap();
        let f = ImageFolder::open(&root, 4, 0).unwrap();
        assert_eq!(f.classes(), ["cats", "dogs"]);
        let (x, y) = f.batch(0, 6).unwrap();
        assert_eq!(x.len(), 6 * 3 * 16);
        for (i, &label) in y.iter().enumerate() {
            let red = x[i * 48]; // first pixel of the red channel
            let want = if label == 0 { (1.0 - MEAN[0]) / STD[0] } else { -MEAN[0] / STD[0] };
            assert!((red - want).abs() < 1e-5);
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}
