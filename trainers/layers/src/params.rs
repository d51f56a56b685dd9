use candle_core::{DType, Device, Result, Tensor, Var};
use remat::rng::RngKey;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// How a parameter starts.
#[derive(Clone, Copy, Debug)]
pub enum Init {
    Zeros,
    Ones,
    Normal { std: f32 },
}

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot {path}: {source}")]
    Io { path: String, source: candle_core::Error },
    #[error("snapshot {path}: tensor `{name}` has shape {found:?}, the model expects {expected:?}")]
    Shape { path: String, name: String, found: Vec<usize>, expected: Vec<usize> },
    #[error("snapshot {path}: the model's parameter `{name}` is missing")]
    Missing { path: String, name: String },
}

/// The named trainable parameters of a model, in name order.
pub struct ParamStore {
    vars: BTreeMap<String, Var>,
    device: Device,
    dtype: DType,
    seed: u64,
}

impl ParamStore {
    /// Parameters are initialised from keys derived from `seed` and their names, so two stores
    /// with the same seed hold bit-identical weights.
    pub fn new(device: &Device, dtype: DType, seed: u64) -> Self {
        ParamStore { vars: BTreeMap::new(), device: device.clone(), dtype, seed }
    }

    /// The parameter `name`, created with `init` on first use (a second use shares it: tied weights).
    pub fn get(&mut self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        if let Some(v) = self.vars.get(name) {
            if v.dims() != shape {
                candle_core::bail!("parameter `{name}` requested with shape {shape:?}, created with {:?}", v.dims())
            }
            return Ok(v.as_tensor().clone());
        }
        let n: usize = shape.iter().product();
        let data = match init {
            Init::Zeros => vec![0f32; n],
            Init::Ones => vec![1f32; n],
            Init::Normal { std } => RngKey::named(self.seed, name).normal(n, 0.0, std),
        };
        let t = Tensor::from_vec(data, shape, &self.device)?.to_dtype(self.dtype)?;
        let var = Var::from_tensor(&t)?;
        self.vars.insert(name.to_string(), var.clone());
        Ok(var.as_tensor().clone())
    }

    /// All parameters, in name order.
    pub fn vars(&self) -> Vec<Var> {
        self.vars.values().cloned().collect()
    }

    pub fn named(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.vars.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of scalar parameters.
    pub fn count(&self) -> usize {
        self.vars.values().map(|v| v.elem_count()).sum()
    }

    /// Writes every parameter to a safetensors snapshot under its name.
    pub fn save(&self, path: &Path) -> std::result::Result<(), SnapshotError> {
        let map: HashMap<String, Tensor> = self.vars.iter().map(|(k, v)| (k.clone(), v.as_tensor().clone())).collect();
        candle_core::safetensors::save(&map, path).map_err(|source| SnapshotError::Io { path: path.display().to_string(), source })
    }

    /// Loads every parameter from a safetensors snapshot. `rename` maps a file's tensor name to
    /// the model's (or `None` to skip it: buffers, tied copies); every parameter must be found.
    pub fn load(&self, path: &Path, rename: impl Fn(&str) -> Option<String>) -> std::result::Result<(), SnapshotError> {
        let p = path.display().to_string();
        let io = |source| SnapshotError::Io { path: p.clone(), source };
        let tensors = candle_core::safetensors::load(path, &self.device).map_err(io)?;
        let mut found: HashMap<String, Tensor> = HashMap::new();
        for (name, t) in tensors {
            if let Some(n) = rename(&name) {
                found.insert(n, t);
            }
        }
        for (name, var) in &self.vars {
            let t = found.remove(name).ok_or_else(|| SnapshotError::Missing { path: p.clone(), name: name.clone() })?;
            if t.dims() != var.dims() {
                return Err(SnapshotError::Shape { path: p.clone(), name: name.clone(), found: t.dims().to_vec(), expected: var.dims().to_vec() });
            }
            var.set(&t.to_dtype(self.dtype).map_err(io)?).map_err(io)?;
        }
        Ok(())
    }
}
