//! The files a run reads, each named with its flag: checked before anything is built (each
//! exists and is what it should be: a regular file, or a folder of them, never a pipe that
//! would block its reader forever), fingerprinted by content for a resume to match, and kept
//! from the run's outputs ([`crate::snapshot::check_outputs`]).

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};

/// A file (or folder of files) a run reads: the flag that names it and what it holds.
pub struct Input {
    /// `--text`, `--model-id's tokenizer.json`: what errors and the resume check call it.
    pub flag: String,
    pub path: PathBuf,
    pub reads: Reads,
    pub shape: Shape,
}

impl Input {
    /// A file.
    pub fn file(flag: &str, path: &Path, reads: Reads) -> Self {
        Input { flag: flag.to_string(), path: path.to_path_buf(), reads, shape: Shape::File }
    }

    /// A folder, of which the files `lists` names are read (a data set's layout: the images in
    /// its class folders).
    pub fn folder(flag: &str, path: &Path, reads: Reads, lists: Lister) -> Self {
        Input { shape: Shape::Folder(lists), ..Input::file(flag, path, reads) }
    }

    /// The files it reads, in a fixed order (a folder's by their path below it); refused unless
    /// each is a regular file, before any is opened.
    pub fn files(&self) -> Result<Vec<PathBuf>> {
        let meta = std::fs::metadata(&self.path)
            .map_err(|e| anyhow::anyhow!("{} {}: {e}", self.flag, self.path.display()))?;
        match self.shape {
            Shape::File if meta.is_file() => Ok(vec![self.path.clone()]),
            Shape::File => bail!(
                "{} {} is {}; give a regular file",
                self.flag,
                self.path.display(),
                kind(&meta)
            ),
            Shape::Folder(lists) if meta.is_dir() => {
                let context = || format!("{} {}", self.flag, self.path.display());
                let files = lists(&self.path).with_context(context)?;
                for file in &files {
                    let meta = std::fs::metadata(file)
                        .with_context(|| format!("{}: {}", context(), file.display()))?;
                    if !meta.is_file() {
                        bail!(
                            "{}: {} is {}; give regular files",
                            context(),
                            file.display(),
                            kind(&meta)
                        );
                    }
                }
                Ok(files)
            }
            Shape::Folder(_) => {
                bail!("{} {} is {}; give a folder", self.flag, self.path.display(), kind(&meta))
            }
        }
    }
}

/// How the resume configuration's entry of an input's content ends: `--text's content`.
pub(crate) const CONTENT: &str = "'s content";

/// What an input holds, as far as the outputs and a resume are concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reads {
    /// Weights the run starts from or continues (`--init`, `--resume`, the `--model-id`'s): its
    /// own snapshot may replace `--init`'s and `--resume`'s, and a resume does not depend on
    /// them (the training snapshot holds every weight).
    Weights,
    /// What decides what the run computes (a configuration, data, a tokenizer, a vocabulary):
    /// its content is in a resume's configuration, and no output may be it.
    Setup,
    /// Anything else (an adapter's files, loaded once): no output may be it.
    Other,
}

/// Whether an input is one file or a folder of them.
#[derive(Clone, Copy, Debug)]
pub enum Shape {
    File,
    /// A folder, with what lists the files of it the run reads.
    Folder(Lister),
}

/// The files a folder input holds that a run reads, in a fixed order (without opening them).
pub type Lister = fn(&Path) -> std::io::Result<Vec<PathBuf>>;

/// The data files of `flags` that are given (`("--text", &args.text)`): each decides what a run
/// computes.
pub fn given(flags: &[(&str, &Option<PathBuf>)]) -> Vec<Input> {
    let given = |(flag, path): &(&str, &Option<PathBuf>)| {
        Some(Input::file(flag, path.as_deref()?, Reads::Setup))
    };
    flags.iter().filter_map(given).collect()
}

/// Refuses, before anything is opened or built, an input that is missing or is not what it
/// should be (a pipe, a device, a folder for a file), naming its flag: a pipe with no writer
/// would block the run in `open` forever, a missing `--resume` fail only after the model is
/// built.
pub fn check(inputs: &[Input]) -> Result<()> {
    inputs.iter().try_for_each(|input| input.files().map(drop))
}

/// The content of every input that decides what the run computes ([`Reads::Setup`]), as
/// `(flag's content, sha256:<its first 16 hex digits>...)`: a resume on an edited file (even of the
/// same size) is refused.
pub fn fingerprints(inputs: &[Input]) -> Result<Vec<(String, String)>> {
    let setup = inputs.iter().filter(|input| input.reads == Reads::Setup);
    setup
        .map(|input| {
            let mut hash = Sha256::new();
            for file in input.files()? {
                // A folder's files by their place in it: a renamed file is another input.
                let name = file.strip_prefix(&input.path).unwrap_or(&file);
                hash.update(name.as_os_str().as_encoded_bytes());
                hash.update([0]);
                hash_file(&file, &mut hash)
                    .with_context(|| format!("{} {}", input.flag, file.display()))?;
            }
            // 64 bits tell two files apart as surely as 256, in a line a person can read.
            let digest: String = hash.finalize()[..8].iter().map(|b| format!("{b:02x}")).collect();
            let key = format!("{}{CONTENT}", input.flag);
            Ok((key, format!("sha256:{digest}...")))
        })
        .collect()
}

/// Feeds the bytes of `path` (length first, so that two files cannot run together) to `hash`.
fn hash_file(path: &Path, hash: &mut Sha256) -> std::io::Result<()> {
    let mut file = std::fs::File::open(path)?;
    hash.update(file.metadata()?.len().to_le_bytes());
    let mut buffer = vec![0; 1 << 20];
    loop {
        match file.read(&mut buffer)? {
            0 => return Ok(()),
            n => hash.update(&buffer[..n]),
        }
    }
}

/// What a path that is not the expected kind is, in words.
fn kind(meta: &std::fs::Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        if t.is_fifo() {
            return "a named pipe";
        }
        if t.is_block_device() || t.is_char_device() {
            return "a device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if meta.is_dir() {
        "a folder"
    } else if meta.is_file() {
        "a file"
    } else {
        "not a regular file"
    }
}

/// Whether two paths name one file: where both exist, the same device and inode; else equal as
/// given, or in the same folder (symlinks and `..` resolved) under the same name.
pub(crate) fn same_file(a: &Path, b: &Path) -> bool {
    // Where both exist, by identity (device and inode): hard links, symbolic links and other
    // spellings of one file are one file.
    #[cfg(unix)]
    if let (Ok(x), Ok(y)) = (std::fs::metadata(a), std::fs::metadata(b)) {
        use std::os::unix::fs::MetadataExt;
        return (x.dev(), x.ino()) == (y.dev(), y.ino());
    }
    a == b || resolved(a).is_some_and(|x| Some(x) == resolved(b))
}

/// `p` with its folder resolved (symlinks and `..`), where the folder exists.
fn resolved(p: &Path) -> Option<PathBuf> {
    let folder = p.parent().filter(|f| !f.as_os_str().is_empty()).unwrap_or(Path::new("."));
    Some(std::fs::canonicalize(folder).ok()?.join(p.file_name()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("trainkit-inputs-{name}-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn an_edit_of_the_same_size_changes_the_fingerprint() {
        let dir = folder("edit");
        let text = dir.join("a.txt");
        std::fs::write(&text, "abcd").unwrap();
        let inputs = [Input::file("--text", &text, Reads::Setup)];
        let before = fingerprints(&inputs).unwrap();
        std::fs::write(&text, "abce").unwrap();
        let after = fingerprints(&inputs).unwrap();
        assert_eq!(before[0].0, "--text's content");
        assert_ne!(before, after);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_pipe_is_refused_before_it_is_opened() {
        let dir = folder("pipe");
        let fifo = dir.join("fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        // Opening it would block forever: no writer ever comes.
        let error = check(&[Input::file("--data", &fifo, Reads::Setup)]).unwrap_err();
        assert!(format!("{error:#}").contains("--data") && format!("{error:#}").contains("pipe"));
        let all = |dir: &Path| -> std::io::Result<Vec<PathBuf>> {
            std::fs::read_dir(dir)?.map(|e| Ok(e?.path())).collect()
        };
        let error = check(&[Input::folder("--data", &dir, Reads::Setup, all)]).unwrap_err();
        assert!(format!("{error:#}").contains("is a named pipe"), "{error:#}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
