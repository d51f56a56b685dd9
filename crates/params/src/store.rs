//! The parameter store and the snapshot files it is saved to and loaded from.

use crate::WeightLayout;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};
use remat::rng::RngKey;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// How a parameter starts.
#[derive(Clone, Copy, Debug)]
pub enum Init {
    Zeros,
    Ones,
    Normal {
        std: f32,
    },
    /// Uniform in [-bound, bound).
    Uniform {
        bound: f32,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot {path}: {source}")]
    Io { path: String, source: candle_core::Error },
    #[error(
        "snapshot {path}: tensor `{name}` has shape {found:?}, the model expects {expected:?}"
    )]
    Shape { path: String, name: String, found: Vec<usize>, expected: Vec<usize> },
    #[error("snapshot {path}: the model's parameter `{name}` is missing")]
    Missing { path: String, name: String },
    #[error(
        "snapshot {path}: tensor `{name}` is not an adapter of this model (the adapter was made \
         for other --lora-targets, or another model)"
    )]
    Unexpected { path: String, name: String },
    #[error(
        "snapshot {path} holds {count} LoRA adapter tensors this model has not (`{first}` \
         first): loaded, they would be dropped and the adapters' training lost"
    )]
    Adapters { path: String, count: usize, first: String },
    #[error(
        "snapshot {path} holds LoRA adapters of {snapshot}, this run's are {model}: loaded, they \
         would be dropped or rescaled; give --lora and --lora-alpha as the run that wrote it did"
    )]
    AdapterConfig { path: String, snapshot: String, model: String },
    #[error(
        "snapshot {path} holds {count} tensors this model has not (`{first}` first): it is \
         another model's weights, or of another configuration"
    )]
    Unknown { path: String, count: usize, first: String },
    #[error("snapshot {path}: tensor `{name}` holds {what}; weights must be finite numbers")]
    NotFinite { path: String, name: String, what: String },
    #[error("{path}: {problem}")]
    Config { path: String, problem: String },
    #[error(
        "snapshot {path} is corrupted: its tensors do not match the checksum written with them"
    )]
    Corrupted { path: String },
}

/// A parameter that a snapshot did not provide, left at its initial value (see
/// [`ParamStore::load_tensors`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Initialised {
    pub name: String,
    /// `None`: absent from the snapshot; else the shape the snapshot had.
    pub found: Option<Vec<usize>>,
}

impl std::fmt::Display for Initialised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.found {
            None => write!(f, "{} (absent)", self.name),
            Some(shape) => write!(f, "{} (shape {shape:?} in the snapshot)", self.name),
        }
    }
}

/// Which parameters do not train: patterns over parameter names, `*` standing for any run of
/// characters (`h.*.attn.*`, `wte.weight`), less those an exception matches. Parsed from a
/// comma-separated list of patterns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Freeze {
    patterns: Vec<String>,
    except: Vec<String>,
}

impl Freeze {
    /// Everything but what `except` matches (LoRA: all but the adapters).
    pub fn all_but(except: &[String]) -> Self {
        Freeze { patterns: vec!["*".into()], except: except.to_vec() }
    }

    /// Whether `name` matches one of the patterns and none of the exceptions.
    pub fn matches(&self, name: &str) -> bool {
        self.patterns.iter().any(|p| glob(p, name)) && !self.except.iter().any(|p| glob(p, name))
    }

    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    pub fn patterns(&self) -> &[String] {
        &self.patterns
    }
}

impl std::str::FromStr for Freeze {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let patterns: Vec<String> =
            s.split(',').map(str::trim).filter(|p| !p.is_empty()).map(String::from).collect();
        if patterns.is_empty() {
            return Err(format!("`{s}` names no parameter pattern (e.g. `h.*.attn.*,wte.weight`)"));
        }
        Ok(Freeze { patterns, except: Vec::new() })
    }
}

/// `pattern` (`*`: any run of characters) matches the whole of `name`.
fn glob(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, rest)) => name.strip_prefix(head).is_some_and(|tail| {
            (0..=tail.len()).filter(|&i| tail.is_char_boundary(i)).any(|i| glob(rest, &tail[i..]))
        }),
    }
}

/// The named parameters of a model, in name order: those that train and those [`Freeze`] keeps
/// fixed; and its buffers (state that is saved and loaded but not trained: BatchNorm running
/// statistics).
pub struct ParamStore {
    vars: BTreeMap<String, Var>,
    frozen: BTreeMap<String, Var>,
    freeze: Freeze,
    buffers: BTreeMap<String, Var>,
    /// The LoRA adapters beside layers, for `ParamStore::merged` (the `lora` module).
    pub(crate) adapters: Vec<AdapterInfo>,
    device: Device,
    dtype: DType,
    seed: u64,
}

/// What merging needs of a layer's adapter: the layer, how it stores its weight, the scale.
pub(crate) struct AdapterInfo {
    pub(crate) layer: String,
    pub(crate) layout: WeightLayout,
    pub(crate) scale: f64,
}

impl ParamStore {
    /// Parameters are initialised from keys derived from `seed` and their names, so two stores
    /// with the same seed hold bit-identical weights.
    pub fn new(device: &Device, dtype: DType, seed: u64) -> Self {
        ParamStore {
            vars: BTreeMap::new(),
            frozen: BTreeMap::new(),
            freeze: Freeze::default(),
            buffers: BTreeMap::new(),
            adapters: Vec::new(),
            device: device.clone(),
            dtype,
            seed,
        }
    }

    /// The store whose parameters matching `freeze` do not train: the model reads them through
    /// tensors no variable leads to, so a backward computes and stores no gradient for them, and
    /// [`ParamStore::vars`] (what optimizers and the executor see) leaves them out.
    pub fn freezing(self, freeze: &Freeze) -> Self {
        ParamStore { freeze: freeze.clone(), ..self }
    }

    /// The parameter `name`, created with `init` on first use (a second use shares it: tied
    /// weights).
    pub fn get(&mut self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        let (seed, device, dtype) = (self.seed, self.device.clone(), self.dtype);
        let create = || create(seed, &device, dtype, name, shape, init);
        if self.freeze.matches(name) {
            // The same storage, not a variable: loading a snapshot into the `Var` still reaches it.
            return Ok(get_or_create(&mut self.frozen, name, shape, create)?.as_tensor().detach());
        }
        Ok(get_or_create(&mut self.vars, name, shape, create)?.as_tensor().clone())
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The frozen parameters, in name order.
    pub fn frozen(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.frozen.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The [`Freeze`] patterns that matched no parameter (a typo freezes nothing).
    pub fn unmatched_freeze_patterns(&self) -> Vec<&str> {
        self.freeze
            .patterns()
            .iter()
            .filter(|p| !self.frozen.keys().any(|n| glob(p, n)))
            .map(String::as_str)
            .collect()
    }

    /// The buffer `name` (f32, not trained), created with `init` on first use.
    pub fn buffer(&mut self, name: &str, shape: &[usize], init: Init) -> Result<Var> {
        let (seed, device) = (self.seed, self.device.clone());
        get_or_create(&mut self.buffers, name, shape, || {
            create(seed, &device, DType::F32, name, shape, init)
        })
    }

    pub fn buffers(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.buffers.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The parameters that train, in name order.
    pub fn vars(&self) -> Vec<Var> {
        self.vars.values().cloned().collect()
    }

    pub fn named(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.vars.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of scalar parameters that train.
    pub fn count(&self) -> usize {
        self.vars.values().map(|v| v.elem_count()).sum()
    }

    /// The parameter count in words, as the trainers print it: `N params`, or with frozen ones
    /// `N trained params (M frozen)`.
    pub fn count_text(&self) -> String {
        match self.frozen.values().map(|v| v.elem_count()).sum::<usize>() {
            0 => format!("{} params", self.count()),
            frozen => format!("{} trained params ({frozen} frozen)", self.count()),
        }
    }

    /// Writes every parameter and buffer to a safetensors snapshot under its name. The file is
    /// written beside the target and renamed over it, so an interrupted write keeps the old one.
    pub fn save(&self, path: &Path) -> std::result::Result<(), SnapshotError> {
        let io = |source| SnapshotError::Io { path: path.display().to_string(), source };
        write_snapshot(path, &self.tensors(), self.metadata()).map_err(io)
    }

    /// Every parameter and buffer under its name, as a snapshot holds them.
    pub fn tensors(&self) -> HashMap<String, Tensor> {
        self.all().map(|(k, v)| (k.clone(), v.as_tensor().clone())).collect()
    }

    /// Loads parameters and buffers from a safetensors snapshot ([`ParamStore::load_tensors`]).
    pub fn load(
        &self,
        path: &Path,
        rename: impl Fn(&str) -> Option<String>,
        replaceable: impl Fn(&str) -> bool,
    ) -> std::result::Result<Vec<Initialised>, SnapshotError> {
        let (tensors, _) = read_snapshot(path, &self.device)?;
        self.load_tensors(tensors, &path.display().to_string(), rename, replaceable)
    }

    /// Loads parameters and buffers from tensors read from the snapshot `origin`. `rename` maps a
    /// file's tensor name to the model's (or `None` to skip it: tied copies, counters). Every
    /// parameter must be found at its shape, except those `replaceable` accepts (a task head a
    /// pre-trained snapshot lacks or has for another number of classes): they keep their initial
    /// values and are returned. Nothing is written unless the whole load succeeds.
    pub fn load_tensors(
        &self,
        tensors: HashMap<String, Tensor>,
        origin: &str,
        rename: impl Fn(&str) -> Option<String>,
        replaceable: impl Fn(&str) -> bool,
    ) -> std::result::Result<Vec<Initialised>, SnapshotError> {
        let p = origin.to_string();
        let io = |source| SnapshotError::Io { path: p.clone(), source };
        let mut found: HashMap<String, Tensor> = HashMap::new();
        for (name, t) in tensors {
            if let Some(n) = rename(&name) {
                found.insert(n, t);
            }
        }
        let (mut updates, mut initialised) = (Vec::new(), Vec::new());
        for (name, var) in self.all() {
            match found.remove(name) {
                Some(t) if t.dims() == var.dims() => updates.push((name, var, t)),
                Some(t) if replaceable(name) => initialised
                    .push(Initialised { name: name.clone(), found: Some(t.dims().to_vec()) }),
                None if replaceable(name) => {
                    initialised.push(Initialised { name: name.clone(), found: None })
                }
                Some(t) => {
                    return Err(SnapshotError::Shape {
                        path: p.clone(),
                        name: name.clone(),
                        found: t.dims().to_vec(),
                        expected: var.dims().to_vec(),
                    })
                }
                None => return Err(SnapshotError::Missing { path: p.clone(), name: name.clone() }),
            }
        }
        if let Some(first) = found.keys().min() {
            let (count, first) = (found.len(), first.clone());
            return Err(SnapshotError::Unknown { path: p, count, first });
        }
        for (name, var, t) in &updates {
            check_finite(var, t).map_err(|what| SnapshotError::NotFinite {
                path: p.clone(),
                name: name.to_string(),
                what,
            })?;
        }
        for (_, var, t) in updates {
            var.set(&t.to_dtype(var.dtype()).and_then(|t| t.to_device(var.device())).map_err(io)?)
                .map_err(io)?;
        }
        Ok(initialised)
    }
}

/// Refuses a tensor loaded into `var` that is not of a float dtype (an integer tensor would be
/// cast into weights silently) or holds a NaN or an infinity (it would surface steps later as
/// non-finite gradients blamed on the data); says which. Buffers of integers (a BatchNorm's
/// batch count) take integers.
fn check_finite(var: &Var, t: &Tensor) -> std::result::Result<(), String> {
    if !var.dtype().is_float() {
        return Ok(());
    }
    if !t.dtype().is_float() {
        return Err(format!("{:?} values where the model has {:?}", t.dtype(), var.dtype()));
    }
    if all_finite(t).map_err(|e| e.to_string())? {
        return Ok(());
    }
    let floats = t.flatten_all().and_then(|t| t.to_dtype(DType::F32));
    let values = floats.and_then(|t| t.to_vec1::<f32>()).map_err(|e| e.to_string())?;
    let (at, v) = values.iter().enumerate().find(|(_, v)| !v.is_finite()).unwrap_or((0, &f32::NAN));
    Err(format!("{v} (element {at} of {})", values.len()))
}

/// Whether every value of the float tensor `t` is finite: x * 0 is 0 for a finite x and NaN for
/// a NaN or an infinity, summed in f32 (a half-precision sum of a large tensor would overflow).
/// One pass; no copy of `t` kept.
pub fn all_finite(t: &Tensor) -> Result<bool> {
    let zeros = t.to_dtype(DType::F32)?.affine(0.0, 0.0)?;
    Ok(zeros.sum_all()?.to_scalar::<f32>()? == 0.0)
}

/// The metadata key of the checksum our snapshots carry.
const CHECKSUM: &str = "checksum";

/// A checksum of safetensors tensors: names, dtypes, shapes and bytes, added in name order. Not
/// cryptographic: it catches a file damaged on disk or in transfer, which would otherwise load
/// as finite garbage or fail steps later as a NaN loss.
struct Checksum(u64);

impl Checksum {
    fn new() -> Self {
        Checksum(0xcbf2_9ce4_8422_2325)
    }

    fn mix(&mut self, w: u64) {
        self.0 = (self.0 ^ w).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29);
    }

    fn add(&mut self, name: &str, dtype: safetensors::Dtype, shape: &[usize], data: &[u8]) {
        format!("{name}:{dtype:?}").bytes().for_each(|b| self.mix(b as u64));
        shape.iter().for_each(|&d| self.mix(d as u64));
        let words = data.chunks_exact(8);
        let tail = words.remainder();
        words.for_each(|w| self.mix(u64::from_le_bytes(w.try_into().expect("8 bytes"))));
        tail.iter().for_each(|&b| self.mix(b as u64));
        self.mix(data.len() as u64);
    }

    fn hex(&self) -> String {
        format!("{:016x}", self.0)
    }
}

/// Writes `tensors` as a safetensors file (atomically: [`write_atomically`]) with `metadata`
/// and a checksum of the tensors, which [`read_snapshot`] verifies.
pub fn write_snapshot(
    path: &Path,
    tensors: &HashMap<String, Tensor>,
    mut metadata: HashMap<String, String>,
) -> Result<()> {
    use safetensors::View;
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut sum = Checksum::new();
    for name in names {
        // One tensor's bytes at a time: a copy of the whole model would double the memory.
        let t = &tensors[name];
        sum.add(name, View::dtype(t), t.dims(), &View::data(t));
    }
    metadata.insert(CHECKSUM.into(), sum.hex());
    write_atomically(path, |tmp| {
        safetensors::serialize_to_file(
            tensors.iter().map(|(k, v)| (k.as_str(), v)),
            Some(metadata),
            tmp,
        )
        .map_err(candle_core::Error::wrap)
    })
}

/// A snapshot's tensors by name, and its metadata.
pub type Snapshot = (HashMap<String, Tensor>, HashMap<String, String>);

/// Whether `path` is a sharded checkpoint's index (`model.safetensors.index.json`).
pub fn is_index(path: &Path) -> bool {
    path.file_name().is_some_and(|n| n.to_string_lossy().ends_with(".safetensors.index.json"))
}

/// The files a sharded checkpoint's index names in its `weight_map`, beside it, each once, in
/// name order.
pub fn shards(index: &Path) -> std::result::Result<Vec<std::path::PathBuf>, SnapshotError> {
    let problem =
        |problem: String| SnapshotError::Config { path: index.display().to_string(), problem };
    let text = std::fs::read_to_string(index).map_err(|e| problem(e.to_string()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| problem(e.to_string()))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| problem("no `weight_map`: not a sharded checkpoint's index".into()))?;
    let mut files: Vec<&str> = map.values().filter_map(|f| f.as_str()).collect();
    files.sort();
    files.dedup();
    // A shard is a file beside the index, never a path elsewhere.
    if let Some(bad) = files.iter().find(|f| Path::new(f).components().count() != 1) {
        return Err(problem(format!("`weight_map` names {bad}, not a file beside the index")));
    }
    let folder = index.parent().unwrap_or(Path::new("."));
    Ok(files.into_iter().map(|f| folder.join(f)).collect())
}

/// Reads a safetensors file: its tensors (on `device`) and its metadata; or a sharded
/// checkpoint through its index ([`is_index`]): every shard's tensors. A file that carries a
/// checksum ([`write_snapshot`]: ours; published files have none) must match it.
pub fn read_snapshot(path: &Path, device: &Device) -> std::result::Result<Snapshot, SnapshotError> {
    if is_index(path) {
        let mut all = HashMap::new();
        for shard in shards(path)? {
            let (tensors, _) = read_snapshot(&shard, device)?;
            all.extend(tensors);
        }
        return Ok((all, HashMap::new()));
    }
    let p = path.display().to_string();
    let io = |source| SnapshotError::Io { path: p.clone(), source };
    let bytes = std::fs::read(path).map_err(|e| io(e.into()))?;
    let file = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| io(e.into()))?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| io(e.into()))?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let mut views = file.tensors();
    if let Some(written) = metadata.get(CHECKSUM) {
        views.sort_by(|a, b| a.0.cmp(&b.0));
        let mut sum = Checksum::new();
        views.iter().for_each(|(name, v)| sum.add(name, v.dtype(), v.shape(), v.data()));
        if sum.hex() != *written {
            return Err(SnapshotError::Corrupted { path: p });
        }
    }
    use candle_core::safetensors::Load;
    let tensors = views
        .into_iter()
        .map(|(name, v)| Ok((name, v.load(device)?)))
        .collect::<Result<_>>()
        .map_err(io)?;
    Ok((tensors, metadata))
}

/// The temporary [`write_atomically`] writes `path` through: `w.safetensors` is written as
/// `w.partial`. One that exists was left by a write the process did not live to finish.
pub fn partial_path(path: &Path) -> std::path::PathBuf {
    path.with_extension("partial")
}

/// Writes a file through `write` to a temporary beside `path`, then renames it over `path`: an
/// interrupted write keeps the previous file, and a failed one leaves no temporary behind. The
/// file is readable by all (0644), as files written by other tools are.
pub fn write_atomically(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = partial_path(path);
    let done = write(&tmp).and_then(|()| {
        #[cfg(unix)]
        std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
        std::fs::rename(&tmp, path)?;
        Ok(())
    });
    if done.is_err() {
        std::fs::remove_file(&tmp).ok();
    }
    done
}

/// Bit patterns of a tensor's values as f32: what "bit for bit" compares.
pub fn f32_bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f32::to_bits)
        .collect())
}

impl ParamStore {
    /// Every parameter's gradient in `grads` as f32 bits, by name; parameters without one are
    /// absent.
    pub fn grad_bits(&self, grads: &GradStore) -> Result<BTreeMap<String, Vec<u32>>> {
        self.vars
            .iter()
            .filter_map(|(n, v)| grads.get(v).map(|g| f32_bits(g).map(|b| (n.clone(), b))))
            .collect()
    }

    /// Every buffer's current value as f32 bits, by name.
    pub fn buffer_bits(&self) -> Result<BTreeMap<String, Vec<u32>>> {
        self.buffers.iter().map(|(n, v)| f32_bits(v.as_tensor()).map(|b| (n.clone(), b))).collect()
    }

    /// Every parameter, trained or frozen, and every buffer, by name.
    pub fn all(&self) -> impl Iterator<Item = (&String, &Var)> {
        self.vars.iter().chain(&self.frozen).chain(self.buffers.iter())
    }
}

fn get_or_create(
    map: &mut BTreeMap<String, Var>,
    name: &str,
    shape: &[usize],
    create: impl FnOnce() -> Result<Var>,
) -> Result<Var> {
    if let Some(v) = map.get(name) {
        if v.dims() != shape {
            candle_core::bail!(
                "`{name}` requested with shape {shape:?}, created with {:?}",
                v.dims()
            )
        }
        return Ok(v.clone());
    }
    let var = create()?;
    map.insert(name.to_string(), var.clone());
    Ok(var)
}

fn create(
    seed: u64,
    device: &Device,
    dtype: DType,
    name: &str,
    shape: &[usize],
    init: Init,
) -> Result<Var> {
    let n: usize = shape.iter().product();
    let data = match init {
        Init::Zeros => vec![0f32; n],
        Init::Ones => vec![1f32; n],
        Init::Normal { std } => RngKey::named(seed, name).normal(n, 0.0, std),
        Init::Uniform { bound } => RngKey::named(seed, name)
            .uniform(n)
            .into_iter()
            .map(|u| (2.0 * u - 1.0) * bound)
            .collect(),
    };
    Var::from_tensor(&Tensor::from_vec(data, shape, device)?.to_dtype(dtype)?)
}
