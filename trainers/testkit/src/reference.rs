//! Reference fixtures: one training step of a tiny model computed by PyTorch
//! (`scripts/make_fixtures.py`), and the comparisons the model tests make against it. The oracle
//! shares no code with ours, so a wrong op cannot pass by being wrong on both sides, as it would
//! in the policy-versus-`off` checks.
//!
//! Errors are measured against the tensor's scale: `max |got - want| / max |want|`. An element's
//! own relative error means nothing for the many gradient elements near zero, and an absolute
//! bound would depend on the model's scale. A gradient's scale is never taken below a thousandth
//! of the model's largest gradient. A gradient that is zero in exact arithmetic (BERT's key bias:
//! softmax ignores a shift shared by all keys; the reference's, in f64, is below 1e-9 of the
//! largest) is rounding noise, ours a sum of f32 products that cancel: its scale is a hundredth
//! of the largest gradient, so it must stay within 1e-6 of it (about 8 f32 ulp of the largest),
//! where a wrong gradient would be orders of magnitude above.

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use params::ParamStore;
use remat::{Executor, StageGraph};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// Tolerances of the comparisons, as scaled errors (see the module documentation). The fixtures
/// are computed in f64 from f32 weights, so what remains is our f32 arithmetic: logits, loss and
/// statistics carry a few units of f32 rounding (~1e-7) amplified by the depth; gradients sum
/// more terms in a different order and cancel more.
pub const LOGITS_TOL: f64 = 1e-5;
pub const LOSS_TOL: f64 = 1e-5;
pub const GRAD_TOL: f64 = 1e-4;
pub const STATS_TOL: f64 = 1e-5;

/// Runs `check` on the fused ops' CPU kernels, then on the device-generic route a GPU takes
/// (`ops::fused::Path::Generic`). The route is process-wide: the test that calls this must be
/// the only one in its binary.
pub fn on_both_routes(check: impl Fn() -> Result<()>) -> Result<()> {
    use ops::fused::{set_path, Path};
    for path in [Path::Kernel, Path::Generic] {
        set_path(path);
        let checked = check();
        set_path(Path::Kernel);
        checked.with_context(|| format!("on the {path:?} route"))?;
    }
    Ok(())
}

/// A fixture file: the weights under their published names, and `fixture.*` entries.
pub struct Fixture {
    path: PathBuf,
    /// The weights alone, written as a snapshot of their own for the model's loaders.
    weights: PathBuf,
    tensors: HashMap<String, Tensor>,
    config: String,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        std::fs::remove_file(&self.weights).ok();
    }
}

impl Fixture {
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("fixture {}", path.display()))?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
            .with_context(|| format!("fixture {}", path.display()))?;
        let config = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get("config"))
            .cloned()
            .context("fixture has no `config` metadata")?;
        let tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)?;
        // The `fixture.*` entries are no weights: a loader refuses a tensor its model has not.
        let weights: HashMap<String, Tensor> = tensors
            .iter()
            .filter(|(name, _)| !name.starts_with("fixture."))
            .map(|(name, t)| (name.clone(), t.clone()))
            .collect();
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let stem = path.file_stem().unwrap_or_default().to_string_lossy();
        let file = format!("fixture-{stem}-{}-{n}.safetensors", std::process::id());
        let weights_path = std::env::temp_dir().join(file);
        params::write_snapshot(&weights_path, &weights, HashMap::new())?;
        Ok(Fixture { path: path.to_path_buf(), weights: weights_path, tensors, config })
    }

    /// The fixture's weights alone as a snapshot, for the model's own loaders.
    pub fn weights(&self) -> &Path {
        &self.weights
    }

    /// The model configuration the fixture was made with (JSON metadata).
    pub fn config<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_str(&self.config)
            .with_context(|| format!("fixture config {}", self.config))
    }

    /// A LoRA fixture's adapters (its config's `lora`: rank, alpha, targets; no dropout), else
    /// `None`.
    pub fn lora(&self) -> Result<Option<params::lora::Lora>> {
        #[derive(serde::Deserialize)]
        struct Peft {
            rank: usize,
            alpha: f64,
            targets: Vec<String>,
        }
        #[derive(serde::Deserialize)]
        struct WithLora {
            lora: Option<Peft>,
        }
        let l = self.config::<WithLora>()?.lora;
        Ok(l.map(|l| params::lora::Lora {
            rank: l.rank,
            alpha: l.alpha,
            dropout: 0.0,
            targets: l.targets,
            init_lora_weights: true,
        }))
    }

    /// Loads the fixture's weights into `model` through its own snapshot loader; a LoRA fixture's
    /// adapter from the folder PEFT wrote beside the file (`<name>-adapter/`), through
    /// [`params::lora::load_adapter`].
    pub fn load_into(&self, model: &impl trainable::Model) -> Result<()> {
        if self.lora()?.is_none() {
            return Ok(model.load_snapshot(&self.weights)?);
        }
        model.init_from(&self.weights, true)?;
        let adapter = self.path.with_file_name(format!(
            "{}-adapter",
            self.path.file_stem().context("fixture file name")?.to_string_lossy()
        ));
        // The configuration PEFT wrote says what the fixture's config does.
        let saved = params::lora::read_adapter_config(&adapter)?.lora;
        let lora = self.lora()?.context("a LoRA fixture")?;
        let set = |t: &[String]| t.iter().cloned().collect::<BTreeSet<_>>();
        ensure!(
            (saved.rank, saved.alpha, set(&saved.targets))
                == (lora.rank, lora.alpha, set(&lora.targets)),
            "{}: {saved:?} is not the fixture's {lora:?}",
            adapter.display()
        );
        Ok(model.load_adapter(&adapter)?)
    }

    /// The entry `fixture.<name>`.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        self.tensors
            .get(&format!("fixture.{name}"))
            .cloned()
            .with_context(|| format!("fixture has no `{name}`"))
    }

    /// An integer entry (token ids, labels) as u32.
    pub fn ids(&self, name: &str) -> Result<Vec<u32>> {
        Ok(self
            .tensor(name)?
            .flatten_all()?
            .to_vec1::<i64>()?
            .into_iter()
            .map(|i| i as u32)
            .collect())
    }

    pub fn f32s(&self, name: &str) -> Result<Vec<f32>> {
        Ok(self.tensor(name)?.flatten_all()?.to_vec1::<f32>()?)
    }

    /// Names under `fixture.<prefix>`, without it.
    fn names(&self, prefix: &str) -> BTreeSet<String> {
        let full = format!("fixture.{prefix}");
        self.tensors.keys().filter_map(|k| k.strip_prefix(&full).map(str::to_string)).collect()
    }
}

/// `max |got - want| / max(max |want|, floor)`, after checking the shapes agree.
pub fn scaled_error(got: &Tensor, want: &Tensor, floor: f64) -> Result<f64> {
    ensure!(
        got.dims() == want.dims(),
        "shape {:?}, the reference has {:?}",
        got.dims(),
        want.dims()
    );
    let flat = |t: &Tensor| -> Result<Vec<f64>> {
        Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
    };
    let (g, w) = (flat(got)?, flat(want)?);
    let scale = max_abs(&w).max(floor);
    let diff = g.iter().zip(&w).fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    Ok(if scale == 0.0 { diff } else { diff / scale })
}

fn max_abs(v: &[f64]) -> f64 {
    v.iter().fold(0f64, |m, x| m.max(x.abs()))
}

/// Fails unless `got` is within `tol` (scaled error) of `want`.
pub fn check_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) -> Result<f64> {
    check_close_floor(what, got, want, tol, 0.0)
}

fn check_close_floor(what: &str, got: &Tensor, want: &Tensor, tol: f64, floor: f64) -> Result<f64> {
    let err = scaled_error(got, want, floor).with_context(|| what.to_string())?;
    ensure!(err <= tol, "{what}: scaled error {err:.3e} exceeds {tol:.0e}");
    Ok(err)
}

/// The model's evaluation loss ([`trainable::Model::evaluate`]) on `inputs` against the
/// cross-entropy of the reference's evaluation logits (classes on the last axis) for `targets`,
/// computed here in f64; evaluating twice gives the same loss and leaves every buffer as it was.
pub fn check_evaluation(
    model: &impl trainable::Model,
    inputs: &[Tensor],
    reference_logits: &Tensor,
    targets: &[u32],
) -> Result<()> {
    let classes = *reference_logits.dims().last().context("scalar logits")?;
    let rows = reference_logits.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    ensure!(
        rows.len() == targets.len() * classes,
        "{} logits for {} targets of {classes} classes",
        rows.len(),
        targets.len()
    );
    let nll: f64 = rows
        .chunks(classes)
        .zip(targets)
        .map(|(row, &t)| {
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
            max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln() - row[t as usize]
        })
        .sum();
    let want = nll / targets.len() as f64;
    let buffers = model.params().buffer_bits()?;
    let got = model.evaluate(inputs)?;
    ensure!(model.evaluate(inputs)? == got, "evaluating twice gave two losses");
    ensure!(model.params().buffer_bits()? == buffers, "evaluation changed a buffer");
    let err = (got as f64 - want).abs() / want.abs().max(1.0);
    ensure!(
        err <= LOSS_TOL,
        "evaluation loss {got} vs {want} from the reference logits: error {err:.3e} exceeds \
         {LOSS_TOL:.0e}"
    );
    Ok(())
}

/// One training step of `graph` under `policy` against the fixture: the loss, the gradient of
/// every parameter (the same set of names on both sides) and, where the fixture has them, every
/// buffer after the step (BatchNorm running statistics). The weights and buffers must be the
/// fixture's, freshly loaded: the step updates the buffers. Returns the largest gradient error.
pub fn check_training_step(
    fx: &Fixture,
    graph: &StageGraph,
    store: &ParamStore,
    inputs: &[Tensor],
    policy: &str,
) -> Result<f64> {
    let exec = Executor::new(graph, &policy.parse()?, store.vars(), 0)?;
    let out = exec.step(inputs, 0)?;
    check_close(&format!("{policy}: loss"), &out.loss, &fx.tensor("loss")?, LOSS_TOL)?;
    let ours: BTreeSet<String> = store.named().map(|(n, _)| n.to_string()).collect();
    ensure!(
        ours == fx.names("grad."),
        "{policy}: parameters differ from the reference: ours {ours:?}, reference {:?}",
        fx.names("grad.")
    );
    let want: Vec<Tensor> =
        store.named().map(|(name, _)| fx.tensor(&format!("grad.{name}"))).collect::<Result<_>>()?;
    let largest = want
        .iter()
        .map(|t| Ok(max_abs(&t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)))
        .collect::<Result<Vec<f64>>>()?;
    let model_largest = largest.iter().fold(0f64, |m, &x| m.max(x));
    let mut worst = 0f64;
    for (((name, var), want), &own_largest) in store.named().zip(&want).zip(&largest) {
        let g =
            out.grads.get(var).with_context(|| format!("{policy}: `{name}` got no gradient"))?;
        // Zero in exact arithmetic: rounding noise (the module documentation).
        let noise = own_largest < 1e-9 * model_largest;
        worst = worst.max(check_close_floor(
            &format!("{policy}: gradient of `{name}`"),
            g,
            want,
            GRAD_TOL,
            if noise { 1e-2 } else { 1e-3 } * model_largest,
        )?);
    }
    let stats = fx.names("after.");
    let buffers: BTreeSet<String> = store.buffers().map(|(n, _)| n.to_string()).collect();
    ensure!(
        stats == buffers,
        "{policy}: buffers differ from the reference: ours {buffers:?}, reference {stats:?}"
    );
    for (name, var) in store.buffers() {
        check_close(
            &format!("{policy}: `{name}` after the step"),
            var.as_tensor(),
            &fx.tensor(&format!("after.{name}"))?,
            STATS_TOL,
        )?;
    }
    Ok(worst)
}
