//! Training snapshots: the weights, the optimizer state, the next step, the loss scaler and the
//! run's flags, written every `--save-every` steps for `--resume` to continue bit for bit; and
//! the files a run writes, checked before it starts.

use crate::args::RunArgs;
use crate::inputs::{same_file, Input, Reads, Shape, CONTENT};
use crate::say;
use crate::scaler::LossScaler;
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Where the training snapshot that goes with the weights snapshot `save` is written.
pub fn training_snapshot_path(save: &Path) -> std::path::PathBuf {
    save.with_extension("train.safetensors")
}

/// The tensor names of a training snapshot: the model's under their own names, the optimizer's
/// and the run's under these prefixes.
const OPTIMIZER: &str = "training.optimizer.";
const NEXT_STEP: &str = "training.next_step";
const SEED: &str = "training.seed";
const LOSS_SCALE: &str = "training.loss_scale";
const GOOD_STEPS: &str = "training.loss_scale_good_steps";

/// The metadata key of a training snapshot's [`RunConfig`].
const CONFIG: &str = "training.config";

/// The [`RunConfig`] entry naming the model a run trains.
const MODEL: &str = "the model";

/// Whether a [`RunConfig`] entry is one that snapshots kept only from the fourth reliability
/// round on: the model, its configuration, the inputs' content.
fn recorded_since_round_four(key: &str) -> bool {
    key.starts_with(MODEL) || key.ends_with(CONTENT)
}

/// The flags that decide what a run computes, kept in its training snapshots: a resumed run must
/// give the same ones, or it would continue another run (AdamW's moments dropped when resuming as
/// SGD, another batch size's data order). Where a run goes and what it writes may differ
/// (`--policy`: gradients are bit-identical under every policy; `--steps`, `--device`, the
/// output files, evaluation). The seed is checked on its own ([`load_training`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct RunConfig(BTreeMap<String, String>);

impl RunConfig {
    /// The shared flags of `run` on `ranks` ranks, and the trainer's own: `setup`, a struct whose
    /// fields are its flags (field `lora_alpha` is `--lora-alpha`; `None` is not given), or a
    /// tuple of such structs.
    pub fn new(run: &RunArgs, ranks: usize, setup: &impl Serialize) -> Result<Self> {
        // Only where given: snapshots from before the flag existed froze nothing.
        let freeze = run.freeze.as_ref().map(|f| f.patterns().join(","));
        let shared = SharedConfig {
            batch: run.batch,
            dtype: run.dtype,
            accumulate: run.accumulate,
            ranks,
            freeze,
            optimizer: run.optimizer,
            lr: run.lr,
        };
        Ok(RunConfig(flags(&(shared, setup))?))
    }

    /// With the model it trains (`GPT-2`) and its configuration, every field (`the model's
    /// attn_pdrop`): a `--config` with another dropout is another run.
    pub fn model(mut self, name: &str, config: &impl Serialize) -> Result<Self> {
        self.0.insert(MODEL.into(), name.into());
        let serde_json::Value::Object(fields) = serde_json::to_value(config)? else {
            bail!("a model's configuration is a struct of fields");
        };
        for (field, value) in fields.into_iter().filter(|(_, v)| !v.is_null()) {
            self.0.insert(format!("the model's {field}"), text(value));
        }
        Ok(self)
    }

    /// With the content of the inputs that decide what it computes
    /// ([`crate::inputs::fingerprints`]): a resume on an edited text or another tokenizer is
    /// another run.
    pub fn contents(mut self, fingerprints: Vec<(String, String)>) -> Self {
        self.0.extend(fingerprints);
        self
    }

    /// Fails naming the first flag whose value differs from `saved`'s (the snapshot's), with both;
    /// first, where the snapshot is of another model, says so.
    fn check_against(&self, saved: &RunConfig, snapshot: &Path) -> Result<()> {
        if let (Some(now), Some(then)) = (self.0.get(MODEL), saved.0.get(MODEL)) {
            if now != then {
                bail!(
                    "--resume {} is a training snapshot of {then}, not of {now}: resume it with \
                     the trainer that wrote it",
                    snapshot.display()
                );
            }
        }
        // Snapshots written before their configuration kept the model and the inputs' content
        // lack those entries: said once, not refused.
        let unrecorded: Vec<&str> = self
            .0
            .keys()
            .filter(|k| !saved.0.contains_key(*k) && recorded_since_round_four(k))
            .map(String::as_str)
            .collect();
        if !unrecorded.is_empty() {
            say!(
                "--resume {}: written before training snapshots kept {}; make sure this run \
                 gives the same",
                snapshot.display(),
                unrecorded.join(", ")
            );
        }
        let flags: std::collections::BTreeSet<&String> = self
            .0
            .keys()
            .filter(|k| saved.0.contains_key(*k) || !recorded_since_round_four(k))
            .chain(saved.0.keys())
            .collect();
        // A file's content last: a flag or field that differs says more than a hash.
        let (contents, named): (Vec<&String>, Vec<&String>) =
            flags.into_iter().partition(|k| k.ends_with(CONTENT));
        for flag in named.into_iter().chain(contents) {
            let (now, then) = (self.0.get(flag), saved.0.get(flag));
            if !same_value(now, then) {
                let show = |v: Option<&String>| v.map_or("not given".to_string(), |v| v.clone());
                bail!(
                    "--resume {}: {flag} is {} in this run but was {} in the run that wrote the \
                     snapshot; resume with the same flags (only --policy, --steps, --device and \
                     the output files may change)",
                    snapshot.display(),
                    show(now),
                    show(then)
                );
            }
        }
        Ok(())
    }
}

/// A data source (`--data`, `--text`) as a run's configuration keeps it, for
/// `#[serde(serialize_with)]` on a trainer's `Setup`: its path made absolute and what it holds
/// (a file's bytes; a folder's files and their bytes), so that a resume on other data, or on
/// the same path with other contents, is refused.
pub fn data_source<S: serde::Serializer>(
    path: &Option<std::path::PathBuf>,
    serializer: S,
) -> std::result::Result<S::Ok, S::Error> {
    let Some(path) = path else { return serializer.serialize_none() };
    let described = describe_source(path).map_err(|e| {
        serde::ser::Error::custom(format!("reading the data source {}: {e}", path.display()))
    })?;
    serializer.serialize_str(&described)
}

/// `path (N bytes)` for a file, `path (F files, N bytes)` for a folder (all files below it).
fn describe_source(path: &Path) -> std::io::Result<String> {
    fn walk(dir: &Path, files: &mut u64, bytes: &mut u64) -> std::io::Result<()> {
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let meta = entry.metadata()?;
            if meta.is_dir() {
                walk(&entry.path(), files, bytes)?;
            } else {
                *files += 1;
                *bytes += meta.len();
            }
        }
        Ok(())
    }
    let absolute = std::fs::canonicalize(path)?;
    let meta = std::fs::metadata(&absolute)?;
    if !meta.is_dir() {
        return Ok(format!("{} ({} bytes)", absolute.display(), meta.len()));
    }
    let (mut files, mut bytes) = (0, 0);
    walk(&absolute, &mut files, &mut bytes)?;
    Ok(format!("{} ({files} files, {bytes} bytes)", absolute.display()))
}

/// The shared flags that decide what a run computes ([`RunConfig`]).
#[derive(Serialize)]
struct SharedConfig {
    batch: usize,
    dtype: trainable::Precision,
    accumulate: usize,
    ranks: usize,
    freeze: Option<String>,
    optimizer: trainable::OptimizerKind,
    lr: f64,
}

/// The fields of `value` as flags and their values (field `lora_alpha` is `--lora-alpha`), the
/// fields of each struct where `value` is a tuple of them; a field that is `None` is left out.
fn flags(value: &impl Serialize) -> Result<BTreeMap<String, String>> {
    fn add(value: serde_json::Value, into: &mut BTreeMap<String, String>) -> Result<()> {
        match value {
            serde_json::Value::Array(parts) => {
                parts.into_iter().try_for_each(|part| add(part, into))
            }
            serde_json::Value::Object(fields) => {
                for (field, value) in fields.into_iter().filter(|(_, v)| !v.is_null()) {
                    into.insert(format!("--{}", field.replace('_', "-")), text(value));
                }
                Ok(())
            }
            serde_json::Value::Null => Ok(()),
            other => bail!("a run's configuration is a struct of flags, not {other}"),
        }
    }
    let mut flags = BTreeMap::new();
    add(serde_json::to_value(value)?, &mut flags)?;
    Ok(flags)
}

/// A configuration value as the resume check shows it: a string as it is, anything else as JSON.
/// A number an `f32` field held is shown as that `f32` (`0.1`, not `0.10000000149011612`).
fn text(value: serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => s,
        serde_json::Value::Number(n) if n.is_f64() => {
            let x = n.as_f64().unwrap_or_default();
            match x as f32 {
                single if single as f64 == x => single.to_string(),
                _ => n.to_string(),
            }
        }
        other => other.to_string(),
    }
}

/// Whether a flag's value in this run and in the snapshot's agree: the same text, the same number
/// written two ways (`4` and `4.0`), or not given in both (older snapshots wrote `not given`).
fn same_value(now: Option<&String>, then: Option<&String>) -> bool {
    fn given(v: Option<&String>) -> Option<&String> {
        v.filter(|v| v.as_str() != "not given")
    }
    match (given(now), given(then)) {
        (Some(a), Some(b)) => a == b || a.parse::<f64>().is_ok_and(|x| b.parse::<f64>() == Ok(x)),
        (a, b) => a == b,
    }
}

/// Writes a training snapshot: every parameter and buffer, the optimizer's `state`, the next step,
/// the seed (the data and every random draw follow from the seed and the step), the f16 loss
/// scaler's state, and the run's `config` with a checksum in the metadata
/// ([`params::write_snapshot`]). Written beside the target and renamed over it, so an interrupted
/// write keeps the previous one.
pub fn save_training(
    path: &Path,
    store: &params::ParamStore,
    state: HashMap<String, Tensor>,
    next_step: usize,
    seed: u64,
    scaler: Option<LossScaler>,
    config: &RunConfig,
) -> Result<()> {
    let mut map = store.tensors();
    map.extend(state.into_iter().map(|(k, v)| (format!("{OPTIMIZER}{k}"), v)));
    map.insert(NEXT_STEP.into(), Tensor::new(next_step as i64, &Device::Cpu)?);
    map.insert(SEED.into(), Tensor::new(seed as i64, &Device::Cpu)?);
    if let Some(s) = scaler {
        map.insert(LOSS_SCALE.into(), Tensor::new(s.scale, &Device::Cpu)?);
        map.insert(GOOD_STEPS.into(), Tensor::new(s.good_steps as i64, &Device::Cpu)?);
    }
    let mut metadata = store.metadata();
    metadata.insert(CONFIG.to_string(), serde_json::to_string(config)?);
    params::write_snapshot(path, &map, metadata)
        .with_context(|| format!("writing {}", path.display()))
}

/// Loads a training snapshot into the model, the optimizer and the loss scaler (where the run
/// has one), after checking its checksum, seed and configuration against this run's; returns the
/// step to continue from.
pub fn load_training(
    path: &Path,
    store: &params::ParamStore,
    opt: &mut dyn optim::TrainOptimizer,
    seed: u64,
    scaler: Option<&mut LossScaler>,
    config: &RunConfig,
) -> Result<usize> {
    let ctx = || format!("--resume {}", path.display());
    let (tensors, metadata) = params::read_snapshot(path, &Device::Cpu).with_context(ctx)?;
    let scalar = |name: &str| -> Result<i64> {
        let t = tensors.get(name).with_context(|| {
            format!("{} is not a training snapshot (no `{name}`)", path.display())
        })?;
        Ok(t.to_scalar::<i64>()?)
    };
    let (next, saved_seed) = (scalar(NEXT_STEP)?, scalar(SEED)?);
    if saved_seed as u64 != seed {
        bail!(
            "{} was written with --seed {saved_seed}; resume with the same seed (this run has \
             {seed})",
            path.display()
        );
    }
    match metadata.get(CONFIG) {
        Some(saved) => {
            config.check_against(&serde_json::from_str(saved).with_context(ctx)?, path)?
        }
        None => say!(
            "--resume {}: written before training snapshots kept their run's flags; make sure this \
             run gives the same ones",
            path.display()
        ),
    }
    if let Some(scaler) = scaler {
        let scale = tensors.get(LOSS_SCALE).with_context(|| {
            format!("{} was not written by an f16 run (no loss scale)", path.display())
        })?;
        *scaler =
            LossScaler { scale: scale.to_scalar::<f64>()?, good_steps: scalar(GOOD_STEPS)? as u64 };
    }
    let state = tensors
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(OPTIMIZER)?.to_string(), v.clone())))
        .collect();
    store
        .load_tensors(
            tensors,
            &path.display().to_string(),
            |n| (!n.starts_with("training.")).then(|| n.to_string()),
            |_| false,
        )
        .with_context(ctx)?;
    opt.set_state(&state).with_context(ctx)?;
    Ok(next as usize)
}

/// Fails now, before any training, if `path` (given with `flag`) cannot be written: a directory,
/// a missing folder, no permission, or something that exists and is not a regular file (a device
/// such as /dev/full, a symlink, a pipe), which writing would replace or feed.
fn check_writable(path: &Path, flag: &str) -> Result<()> {
    if path.is_dir() {
        bail!("{flag} {} is a directory; give a file name", path.display());
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_file() {
            let kind = if meta.file_type().is_symlink() {
                "a symbolic link"
            } else {
                "not a regular file"
            };
            bail!(
                "{flag} {} exists and is {kind}; give the path of a regular file (it would be \
                 replaced)",
                path.display()
            );
        }
    }
    let probe = path.with_extension("probe");
    std::fs::File::create(&probe)
        .with_context(|| format!("{flag} {}: cannot write there", path.display()))?;
    std::fs::remove_file(&probe).ok();
    Ok(())
}

/// Removes, with a word, the temporaries ([`params::partial_path`]) that writes of this run's
/// snapshots left when their process was killed: the next write would replace them anyway, and
/// left alone they would lie beside the snapshots looking like one. One the run reads (`--init
/// w.partial`) is an input, not a leftover: it stays, and the snapshot write is refused.
pub(crate) fn remove_stale_partials(
    run: &RunArgs,
    extra: &[Output],
    inputs: &[Input],
) -> Result<()> {
    let training = run.save.as_deref().map(training_snapshot_path);
    let mut targets: Vec<std::path::PathBuf> =
        [run.save.as_deref(), training.as_deref()].into_iter().flatten().map(Into::into).collect();
    for output in extra {
        match *output {
            Output::File(_, path) => targets.push(path.into()),
            Output::Folder(_, dir, names) => targets.extend(names.iter().map(|n| dir.join(n))),
        }
    }
    for target in targets {
        let stale = params::partial_path(&target);
        if let Some(input) = inputs.iter().find(|input| same_file(&input.path, &stale)) {
            bail!(
                "{} {} is where {} is written before it is renamed into place; give the input \
                 another name or write elsewhere",
                input.flag,
                stale.display(),
                target.display()
            );
        }
        if std::fs::symlink_metadata(&stale).is_ok_and(|m| m.is_file()) {
            std::fs::remove_file(&stale)
                .with_context(|| format!("removing {}", stale.display()))?;
            say!(
                "removed {}: left by a write of {} that did not finish",
                stale.display(),
                target.display()
            );
        }
    }
    Ok(())
}

/// A path a run writes besides the shared flags' (`--save-merged`, `--save-adapter`): a file, or
/// a folder and the files it writes into it.
pub enum Output<'a> {
    File(&'static str, &'a Path),
    Folder(&'static str, &'a Path, &'static [&'static str]),
}

/// Every path a run writes, checked once, before training: `--save`, its training snapshot and
/// `--log-json`, and the trainer's `extra` outputs. Each file must be writable
/// ([`check_writable`]); a folder must be one, or creatable, and not a link (its files would be
/// written wherever it points); no two may be the same (`--save X --log-json X` would interleave
/// a log with a snapshot, `--save X --save-merged X` keep only the last written), and none may be
/// a file the run reads (`inputs`: `--init w --log-json w` would turn the weights into a log).
pub(crate) fn check_outputs(run: &RunArgs, extra: &[Output], inputs: &[Input]) -> Result<()> {
    let training = run.save.as_deref().map(training_snapshot_path);
    let shared = [
        ("--save", run.save.as_deref()),
        ("--save's training snapshot", training.as_deref()),
        ("--log-json", run.log_json.as_deref()),
    ];
    let mut files: Vec<(String, std::path::PathBuf)> = shared
        .into_iter()
        .filter_map(|(flag, path)| Some((flag.to_string(), path?.to_path_buf())))
        .collect();
    let mut written = files.clone();
    for output in extra {
        match *output {
            Output::File(flag, path) => {
                files.push((flag.to_string(), path.to_path_buf()));
                written.push((flag.to_string(), path.to_path_buf()));
            }
            Output::Folder(flag, dir, names) => {
                let exists = check_folder(dir, flag)?;
                written.push((flag.to_string(), dir.to_path_buf()));
                for name in names {
                    let path = dir.join(name);
                    if exists {
                        files.push((format!("{flag}'s {name}"), path.clone()));
                    }
                    written.push((format!("{flag}'s {name}"), path));
                }
            }
        }
    }
    for (flag, path) in &files {
        check_writable(path, flag)?;
    }
    // Each input's files, a folder's listed once for every output.
    let read: Vec<(&Input, Vec<std::path::PathBuf>)> = inputs
        .iter()
        .map(|input| match input.shape {
            Shape::File => (input, vec![input.path.clone()]),
            Shape::Folder(_) => (input, input.files().unwrap_or_default()),
        })
        .collect();
    for (i, (flag, path)) in written.iter().enumerate() {
        if let Some((other, _)) = written[..i].iter().find(|(_, p)| same_file(p, path)) {
            bail!("{flag} and {other} are both {}; give each its own file", path.display());
        }
        // A snapshot is written beside its target and renamed over it, after the weights it
        // continues were read: a resume may save over the training snapshot it resumed.
        let snapshot = [run.save.as_deref(), training.as_deref()].contains(&Some(path.as_path()));
        let destroyed = read
            .iter()
            .filter(|(input, _)| !(snapshot && input.reads == Reads::Weights))
            .find(|(_, files)| files.iter().any(|f| same_file(f, path)));
        if let Some((input, _)) = destroyed {
            let what = match input.shape {
                Shape::File => "is the file",
                Shape::Folder(_) => "is a file of the folder",
            };
            bail!(
                "{flag} {} {what} {} {} reads: the run would destroy its own input; write \
                 elsewhere",
                path.display(),
                input.flag,
                input.path.display()
            );
        }
    }
    Ok(())
}

/// Fails now if the folder `dir` (given with `flag`) cannot take the files written into it: it
/// exists and is not a folder, or is a symbolic link, or cannot be created. Returns whether it
/// exists (its files are then checked as files).
fn check_folder(dir: &Path, flag: &str) -> Result<bool> {
    match std::fs::symlink_metadata(dir) {
        Ok(meta) if meta.file_type().is_symlink() => bail!(
            "{flag} {} is a symbolic link; give the path of a folder (what it points to would be \
             overwritten)",
            dir.display()
        ),
        Ok(meta) if !meta.is_dir() => {
            bail!("{flag} {} exists and is not a folder; give the path of a folder", dir.display())
        }
        Ok(_) => Ok(true),
        Err(_) => {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("{flag} {}: cannot create it", dir.display()))?;
            std::fs::remove_dir(dir).ok();
            Ok(false)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(entries: &[(&str, &str)]) -> RunConfig {
        RunConfig(entries.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    /// A ResNet snapshot resumed by `train-gpt2` said "--classes is not given in this run but
    /// was 10", as if a flag were missing.
    #[test]
    fn another_models_snapshot_is_named_as_such() {
        let resnet = config(&[(MODEL, "ResNet"), ("--classes", "10")]);
        let gpt2 = config(&[(MODEL, "GPT-2"), ("--seq", "16")]);
        let error = gpt2.check_against(&resnet, Path::new("r.train.safetensors")).unwrap_err();
        let said = error.to_string();
        assert!(said.contains("is a training snapshot of ResNet, not of GPT-2"), "{said}");
    }

    /// A snapshot written before the model and the inputs' content were kept resumes (with a
    /// word); a flag it lacks is still refused.
    #[test]
    fn entries_older_snapshots_lack_are_not_refused_but_flags_are() {
        let old = config(&[("--seq", "16")]);
        let now = config(&[
            (MODEL, "GPT-2"),
            ("the model's n_embd", "32"),
            ("--text's content", "sha256:00"),
            ("--seq", "16"),
        ]);
        now.check_against(&old, Path::new("w.train.safetensors")).unwrap();
        let with_flag = config(&[("--seq", "16"), ("--freeze", "wte")]);
        assert!(with_flag.check_against(&old, Path::new("w.train.safetensors")).is_err());
    }
}
