//! The results of a matrix run and the questions asked of them (records by configuration, the
//! depth sweep's exponent); `matrix.json` is their file. Rendering them (CSV, Markdown, table,
//! plots) is the job of `report`, which reads this module; it renders nothing.

use super::record::{Baseline, Projection, Record, Status};
use crate::workloads::Profile;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Where and how the results were produced.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Meta {
    pub machine: String,
    pub candle_version: String,
    pub git_commit: String,
    pub command: String,
    pub profile: String,
    /// CPU runs: the machine's matrix-product rate at its best, in GFLOP/s
    /// ([`ops::matmul_peak_gflops`]), measured when the run started.
    #[serde(default)]
    pub matmul_peak_gflops: Option<f64>,
}

/// What made results from now: the machine, candle, the commit, this command, the profile, and on
/// the CPU the matrix product's best rate (about a second to measure).
pub fn meta(profile: Profile, device: &trainkit::DeviceName) -> Meta {
    Meta {
        machine: machine(),
        candle_version: env!("CANDLE_VERSION").into(),
        git_commit: commit(),
        command: super::results::this_command(),
        profile: profile.name().into(),
        matmul_peak_gflops: (*device == trainkit::DeviceName::Cpu).then(ops::matmul_peak_gflops),
    }
}

/// This machine as results name it: the CPU's model, how many CPUs the run sees, candle's
/// threads, and the vector extensions the matrix products can use.
pub fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string());
    // The vector extensions the matrix products can use: the same model name can come with or
    // without AVX-512, and the kernels gemm picks follow them.
    let flags: Vec<&str> = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("flags"))
        .map_or(Vec::new(), |l| l.split_whitespace().collect());
    let vector: Vec<&str> = ["avx2", "fma", "avx512f", "avx512vl", "avx512_bf16", "amx_tile"]
        .into_iter()
        .filter(|f| flags.contains(f))
        .collect();
    let vector = if vector.is_empty() { String::new() } else { format!("; {}", vector.join(" ")) };
    format!(
        "{} ({} CPUs visible, candle threads {}{vector})",
        cpu.unwrap_or_else(|| std::env::consts::ARCH.into()),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        candle_core::utils::get_num_threads()
    )
}

/// Whether two `machine`s (results folders' or this one's) have the same processor: its model,
/// and its vector extensions where both name them (older folders do not). Results measured on
/// another processor do not belong in one table.
pub fn same_processor(a: &str, b: &str) -> bool {
    let parts = |m: &str| {
        let name = m.split(" (").next().unwrap_or(m).to_string();
        (name, m.split_once("; ").map(|(_, v)| v.trim_end_matches(')').to_string()))
    };
    let ((name_a, vector_a), (name_b, vector_b)) = (parts(a), parts(b));
    name_a == name_b && (vector_a.is_none() || vector_b.is_none() || vector_a == vector_b)
}

/// The commit the harness was built from, `-dirty` where its code differed from it (build.rs):
/// what measured, whatever the working tree holds when it runs.
pub fn commit() -> String {
    env!("HARNESS_COMMIT").to_string()
}

/// What made a set of results, in words: "Command: `A`", or the commands in the order of what
/// they made, where a folder's results come from several runs. Results from before results named
/// their command are said to come from earlier runs, `last_run` (the folder's last) among them.
pub fn made_by<'a>(commands: impl IntoIterator<Item = &'a str>, last_run: &str) -> String {
    let (mut named, mut unnamed) = (Vec::new(), false);
    for c in commands {
        match c {
            "" => unnamed = true,
            c if !named.contains(&c) => named.push(c),
            _ => {}
        }
    }
    let list = named.iter().map(|c| format!("`{c}`")).collect::<Vec<_>>().join("; ");
    match (named.len(), unnamed) {
        (0, false) => "Command: none".into(),
        (0, true) => format!(
            "Command of the last run: `{last_run}` (earlier runs may have made some of these \
             results: their commands were not recorded)"
        ),
        (1, false) => format!("Command: {list}"),
        (_, false) => format!(
            "Commands (in the order of the results they made; matrix.json names each result's): \
             {list}"
        ),
        (_, true) => format!(
            "Commands: {list}; the other results by earlier runs, whose commands were not recorded"
        ),
    }
}

/// The two sets of models a results folder can hold: the profile's, or the depth sweep's GPT-2
/// block stacks (named `depth-<L>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Models {
    Profile,
    DepthSweep,
}

impl Models {
    /// The set `model` belongs to.
    fn of(model: &str) -> Models {
        if model.starts_with(crate::workloads::DEPTH_PREFIX) {
            Models::DepthSweep
        } else {
            Models::Profile
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Matrix {
    pub meta: Meta,
    pub records: Vec<Record>,
    /// The same configurations in PyTorch (`--baseline pytorch`).
    #[serde(default)]
    pub baselines: Vec<Baseline>,
    /// The article's configurations at full size, predicted by the planner.
    #[serde(default)]
    pub projections: Vec<Projection>,
    /// Each model's step compiled by torch.compile, one per activation memory budget
    /// (`--baseline pytorch-compile`; policy `memory-budget=F`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub compiled: Vec<Baseline>,
}

impl Matrix {
    /// The profile that made it, where the harness still has one of that name.
    pub fn profile(&self) -> Option<Profile> {
        use clap::ValueEnum;
        Profile::value_variants().iter().copied().find(|p| p.name() == self.meta.profile)
    }

    /// The commands that made the records: each one's measuring run, then those that took times
    /// again (see [`made_by`]).
    pub fn record_commands(&self) -> impl Iterator<Item = &str> {
        let retimes =
            self.records.iter().map(|r| r.times_command.as_str()).filter(|c| !c.is_empty());
        self.records.iter().map(|r| r.command.as_str()).chain(retimes)
    }

    pub fn load(dir: &Path) -> Result<Option<Matrix>> {
        let path = dir.join("matrix.json");
        if !path.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path)?;
        let matrix: Matrix = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a matrix file", path.display()))?;
        if let Some(twice) = matrix.repeated() {
            bail!(
                "{} holds two {twice}, where a results folder has one (a hand merge of two \
                 folders?): remove one of them",
                path.display()
            );
        }
        Ok(Some(matrix))
    }

    /// The first configuration that has two records, two PyTorch records or two projections
    /// (records are keyed by model and policy, projections by model), in words; `None` if none.
    /// Every reader finds the first alone, and the reports would show both.
    fn repeated(&self) -> Option<String> {
        fn first_twice<'a, T>(list: &'a [T], key: impl Fn(&'a T) -> String) -> Option<String> {
            let mut seen = std::collections::HashSet::new();
            list.iter().map(key).find(|k| !seen.insert(k.clone()))
        }
        let model_policy = |model: &str, policy: &str| format!("{model} {policy}");
        first_twice(&self.records, |r| model_policy(&r.model, &r.policy))
            .map(|k| format!("records of {k}"))
            .or_else(|| {
                first_twice(&self.baselines, |b| model_policy(&b.model, &b.policy))
                    .map(|k| format!("PyTorch records of {k}"))
            })
            .or_else(|| {
                first_twice(&self.projections, |p| p.model.clone())
                    .map(|k| format!("projections of {k}"))
            })
    }

    /// The names of the models of `set`, in run order.
    pub fn models(&self, set: Models) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for r in &self.records {
            if Models::of(&r.model) == set && !names.contains(&r.model) {
                names.push(r.model.clone());
            }
        }
        names
    }

    /// The successful records of a model.
    pub fn ok_rows(&self, model: &str) -> Vec<&Record> {
        self.records.iter().filter(|r| r.model == model && r.status == Status::Ok).collect()
    }

    pub fn find(&self, model: &str, policy: &str) -> Option<&Record> {
        self.records.iter().find(|r| r.model == model && r.policy == policy)
    }

    /// Adds or replaces the record of its (model, policy).
    pub fn put(&mut self, rec: Record) {
        replace_or_push(&mut self.records, rec, |r| (&r.model, &r.policy));
    }

    pub fn find_baseline(&self, model: &str, policy: &str) -> Option<&Baseline> {
        self.baselines.iter().find(|b| b.model == model && b.policy == policy)
    }

    /// Adds or replaces the PyTorch record of its (model, policy).
    pub fn put_baseline(&mut self, b: Baseline) {
        replace_or_push(&mut self.baselines, b, |r| (&r.model, &r.policy));
    }

    /// The compiled run of `model` under `policy` (`memory-budget=F`).
    pub fn find_compiled(&self, model: &str, policy: &str) -> Option<&Baseline> {
        self.compiled.iter().find(|b| b.model == model && b.policy == policy)
    }

    /// Adds or replaces the compiled run of its (model, policy).
    pub fn put_compiled(&mut self, b: Baseline) {
        replace_or_push(&mut self.compiled, b, |r| (&r.model, &r.policy));
    }

    /// Adds or replaces the projection of its model.
    pub fn put_projection(&mut self, p: Projection) {
        replace_or_push(&mut self.projections, p, |r| (&r.model, &r.model));
    }

    /// The fitted exponents of activation peak against depth, for `off` and `sqrt`.
    pub fn depth_fits(&self) -> Vec<(String, f64)> {
        ["off", "sqrt"]
            .iter()
            .filter_map(|&p| {
                let pts: Vec<(f64, f64)> = self
                    .models(Models::DepthSweep)
                    .iter()
                    .filter_map(|m| {
                        self.find(m, p)
                            .filter(|r| r.status == Status::Ok)
                            .map(|r| (depth_of(m) as f64, r.activation_peak_bytes as f64))
                    })
                    .collect();
                fit_exponent(&pts).map(|k| (p.to_string(), k))
            })
            .collect()
    }

    /// The planner's error on every measured record that carries a prediction: predicted step
    /// peak over measured, less one.
    pub fn planner_errors(&self) -> Vec<(f64, &Record)> {
        self.records
            .iter()
            .filter(|r| r.status == Status::Ok && r.step_peak_bytes > 0)
            .filter_map(|r| {
                Some((r.predicted_peak_bytes? as f64 / r.step_peak_bytes as f64 - 1.0, r))
            })
            .collect()
    }

    /// Writes only the JSON (after each configuration; plots are drawn once at the end).
    pub fn save_json(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        super::write_file(&dir.join("matrix.json"), serde_json::to_string_pretty(self)?)
    }
}

/// Replaces the item of `list` with `item`'s key, or appends `item`.
fn replace_or_push<T>(list: &mut Vec<T>, item: T, key: impl Fn(&T) -> (&String, &String)) {
    match list.iter().position(|x| key(x) == key(&item)) {
        Some(at) => list[at] = item,
        None => list.push(item),
    }
}

/// The depth of a depth-sweep model, named `depth-<L>`.
pub fn depth_of(model: &str) -> usize {
    model.strip_prefix(crate::workloads::DEPTH_PREFIX).and_then(|d| d.parse().ok()).unwrap_or(0)
}

/// Least-squares slope of log(y) against log(x): the exponent k of y ~ x^k.
pub fn fit_exponent(points: &[(f64, f64)]) -> Option<f64> {
    let pts: Vec<(f64, f64)> =
        points.iter().filter(|p| p.0 > 0.0 && p.1 > 0.0).map(|p| (p.0.ln(), p.1.ln())).collect();
    if pts.len() < 2 {
        return None;
    }
    let n = pts.len() as f64;
    let (mx, my) =
        (pts.iter().map(|p| p.0).sum::<f64>() / n, pts.iter().map(|p| p.1).sum::<f64>() / n);
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

/// This harness command line, as results name what made them.
pub fn this_command() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::super::record::{Baseline, Record};

    /// Records and PyTorch's are keyed by (model, policy): one model under two policies is two
    /// configurations, one configuration twice is refused.
    #[test]
    fn a_configuration_recorded_twice_is_found() {
        let rec = |model: &str, policy: &str| Record {
            model: model.into(),
            policy: policy.into(),
            ..Record::default()
        };
        let baseline = |model: &str, policy: &str| Baseline {
            model: model.into(),
            policy: policy.into(),
            ..Baseline::default()
        };
        let mut m = super::Matrix {
            records: vec![rec("gpt2-tiny", "off"), rec("gpt2-tiny", "sqrt"), rec("bert", "off")],
            baselines: vec![baseline("gpt2-tiny", "off"), baseline("gpt2-tiny", "sqrt")],
            ..super::Matrix::default()
        };
        assert_eq!(m.repeated(), None);
        m.baselines.push(baseline("gpt2-tiny", "sqrt"));
        assert_eq!(m.repeated().as_deref(), Some("PyTorch records of gpt2-tiny sqrt"));
        m.records.push(rec("bert", "off"));
        assert_eq!(m.repeated().as_deref(), Some("records of bert off"));
    }

    #[test]
    fn fits_a_power_law() {
        let pts: Vec<(f64, f64)> =
            [16.0, 64.0, 256.0].iter().map(|&l: &f64| (l, 3.0 * l.powf(0.5))).collect();
        assert!((super::fit_exponent(&pts).unwrap() - 0.5).abs() < 1e-9);
        assert_eq!(super::fit_exponent(&pts[..1]), None);
    }
}
