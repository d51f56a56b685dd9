//! The kernel bench's results (`bench-harness kernels`): every convolution of the models with
//! how often each model runs it, our times and PyTorch's, as `convs.json` and `convs.md`: per
//! model the total of its convolutions (each time the count it runs), then per convolution.
//!
//! The experiment's other layers: [`crate::run::kernels`] (the command: the rounds, PyTorch's
//! side) and [`crate::measure::kernels`] (the recording and the timing).

use anyhow::Result;
use ops::ConvCall;
use std::fmt::Write as _;
use std::path::Path;

/// Median milliseconds of one convolution's forward, input-gradient backward (where the model
/// needs it) and weight-gradient backward.
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct ConvTimes {
    pub forward_ms: f64,
    pub input_grad_ms: Option<f64>,
    pub weight_grad_ms: f64,
}

/// One distinct convolution: which models run it how many times per forward, and each side's
/// times (medians over the rounds).
pub struct Entry {
    pub call: ConvCall,
    pub counts: Vec<(String, usize)>,
    pub ours: Option<ConvTimes>,
    pub torch: Option<ConvTimes>,
}

pub struct KernelReport {
    /// The processor ([`super::results::machine`]).
    pub machine: String,
    /// PyTorch's version and CPU capability, where it ran.
    pub torch: Option<String>,
    pub entries: Vec<Entry>,
}

impl KernelReport {
    pub fn new(machine: String) -> Self {
        KernelReport { machine, torch: None, entries: Vec::new() }
    }

    /// `model` runs `call` once more per forward.
    pub fn add(&mut self, model: &str, call: ConvCall) {
        let entry = match self.entries.iter().position(|e| e.call == call) {
            Some(i) => &mut self.entries[i],
            None => {
                self.entries.push(Entry { call, counts: Vec::new(), ours: None, torch: None });
                self.entries.last_mut().expect("just pushed")
            }
        };
        match entry.counts.iter_mut().find(|(m, _)| m == model) {
            Some((_, n)) => *n += 1,
            None => entry.counts.push((model.to_string(), 1)),
        }
    }

    /// The models in the order they were added.
    fn models(&self) -> Vec<&str> {
        let mut models: Vec<&str> = Vec::new();
        for (m, _) in self.entries.iter().flat_map(|e| &e.counts) {
            if !models.contains(&m.as_str()) {
                models.push(m);
            }
        }
        models
    }

    /// Writes `convs.json` and `convs.md` into `dir`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        super::write_file(&dir.join("convs.json"), serde_json::to_string_pretty(&self.json())?)?;
        super::write_file(&dir.join("convs.md"), self.markdown())
    }

    fn json(&self) -> serde_json::Value {
        let entries = self.entries.iter().map(|e| {
            serde_json::json!({
                "kind": e.call.kind.name(),
                "shapes": e.call.shapes,
                "geometry": e.call.geometry,
                "input_gradient": e.call.needs_input_gradient(),
                "macs": e.call.macs(),
                "counts": e.counts,
                "ours": e.ours,
                "torch": e.torch,
            })
        });
        serde_json::json!({
            "machine": self.machine,
            "threads": candle_core::utils::get_num_threads(),
            "torch": self.torch,
            "command": super::results::this_command(),
            "commit": super::results::commit(),
            "convolutions": entries.collect::<Vec<_>>(),
        })
    }

    fn markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# Convolutions of the `cpu` models, ours and PyTorch's\n\nMachine: {}, {} threads \
             on each side; PyTorch {}. Made by `{}` at commit {}: every convolution the models \
             run, recorded from a forward pass at the `cpu` profile's sizes, timed on random \
             operands of its shapes: the forward, the input gradient's backward (where the model \
             needs it: not the stem's) and the weight gradient's, each alone and from a random \
             output gradient, the median of the rounds' medians (ours and PyTorch's rounds \
             interleaved).\n",
            self.machine,
            candle_core::utils::get_num_threads(),
            self.torch.as_deref().unwrap_or("not run"),
            super::results::this_command(),
            super::results::commit(),
        );
        self.model_totals(&mut out);
        self.per_convolution(&mut out);
        out
    }

    /// Per model: its convolutions' time per forward and backward, each convolution's times
    /// the count it runs, ours and PyTorch's.
    fn model_totals(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "## Per model\n\nEach convolution's time times how often the model runs it, summed \
             (ms); ours / PyTorch's.\n\n| model | convolutions | forward | input gradient | \
             weight gradient | all |\n|---|---|---|---|---|---|"
        );
        for model in self.models() {
            let runs: Vec<(&Entry, f64)> = self
                .entries
                .iter()
                .filter_map(|e| {
                    let n = e.counts.iter().find(|(m, _)| m == model)?.1;
                    Some((e, n as f64))
                })
                .collect();
            let total = |side: fn(&Entry) -> Option<ConvTimes>, part: fn(&ConvTimes) -> f64| {
                runs.iter().map(|(e, n)| side(e).map_or(f64::NAN, |t| part(&t)) * n).sum::<f64>()
            };
            let parts: [fn(&ConvTimes) -> f64; 4] = [
                |t| t.forward_ms,
                |t| t.input_grad_ms.unwrap_or(0.0),
                |t| t.weight_grad_ms,
                |t| t.forward_ms + t.input_grad_ms.unwrap_or(0.0) + t.weight_grad_ms,
            ];
            let cells: Vec<String> = parts
                .iter()
                .map(|&part| pair(total(|e| e.ours, part), total(|e| e.torch, part)))
                .collect();
            let calls: f64 = runs.iter().map(|(_, n)| n).sum();
            let _ = writeln!(out, "| {model} | {calls} | {} |", cells.join(" | "));
        }
        out.push('\n');
    }

    /// One row per convolution: its shapes, who runs it, each part's times and our GFLOP/s.
    fn per_convolution(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "## Per convolution\n\nms, ours / PyTorch's (ratio); GFLOP/s of our forward.\n\n| op \
             | input | weight | stride, pad | runs per forward | forward | input gradient | \
             weight gradient | ours GFLOP/s |\n|---|---|---|---|---|---|---|---|---|"
        );
        for e in &self.entries {
            let c = &e.call;
            let (ours, torch) = (e.ours.unwrap_or_default(), e.torch);
            let grad = |t: &ConvTimes| t.input_grad_ms.unwrap_or(f64::NAN);
            let input_grad = match ours.input_grad_ms {
                Some(_) => pair(grad(&ours), torch.map_or(f64::NAN, |t| grad(&t))),
                None => "-".into(),
            };
            let runs: Vec<String> = e.counts.iter().map(|(m, n)| format!("{m} {n}")).collect();
            let (sd, shw, pd, phw) = c.geometry;
            let _ = writeln!(
                out,
                "| {} | {:?} | {:?} | {} | {} | {} | {input_grad} | {} | {:.0} |",
                c.kind.name(),
                c.shapes[0],
                c.shapes[c.data_operands()],
                if c.shapes[0].len() == 5 {
                    format!("{sd}/{shw}, {pd}/{phw}")
                } else {
                    format!("{shw}, {phw}")
                },
                runs.join(", "),
                pair(ours.forward_ms, torch.map_or(f64::NAN, |t| t.forward_ms)),
                pair(ours.weight_grad_ms, torch.map_or(f64::NAN, |t| t.weight_grad_ms)),
                2.0 * c.macs() as f64 / ours.forward_ms / 1e6,
            );
        }
    }
}

/// "ours / theirs (ratio)" in ms, or ours alone where PyTorch did not run.
fn pair(ours: f64, theirs: f64) -> String {
    if theirs.is_nan() {
        return format!("{ours:.2}");
    }
    format!("{ours:.2} / {theirs:.2} ({:.2}x)", ours / theirs)
}
