//! Data parallelism for the trainers: starting the ranks, averaging each step's gradients across
//! them while the executor recomputes, sharding the optimizer state (ZeRO stage 1) and checking
//! that they stay in sync.

use crate::RunArgs;
use anyhow::{bail, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
pub use collective::Group;
use optim::TrainOptimizer;
use remat::Executor;
use std::collections::HashMap;
use trainable::OptimizerKind;

/// The ranks of this run and this rank's device (`--device`; plain `cuda` is the rank's GPU
/// under one process per GPU), made once: an NCCL group works on that device's stream. With
/// `--ranks N` (N > 1) outside a launcher, runs this very command under `mpirun -np N` (or one
/// process per GPU), waits, and returns `None` (the ranks did the work; a failed rank makes this
/// fail). Under a launcher, the launcher's ranks; otherwise one. Every rank but the first is
/// quiet.
pub fn launch(run: &RunArgs) -> Result<Option<(Group, candle_core::Device)>> {
    run.check()?;
    let device = run.device.open()?;
    ops::allocate_matmul_workspaces();
    let group = Group::from_launcher(&device)?;
    if run.ranks > 1 && group.world() == 1 {
        let (feature, built) = if run.device.is_cuda() {
            ("nccl", cfg!(feature = "nccl"))
        } else {
            ("mpi", cfg!(feature = "mpi"))
        };
        if !built {
            let exe = std::env::current_exe().ok();
            bail!(needs_feature(run.ranks, &run.device, feature, exe.as_deref()));
        }
        let (how, status) = match run.device.is_cuda() {
            true => ("one process per GPU", one_process_per_gpu(run.ranks)?),
            false => ("mpirun", under_mpirun(run.ranks)?),
        };
        if !status.success() {
            bail!("--ranks {} ({how}): {status}", run.ranks);
        }
        return Ok(None);
    }
    if run.ranks > 1 && run.ranks != group.world() {
        bail!("--ranks {} under a launcher of {} ranks", run.ranks, group.world());
    }
    check_sharding(OptimizerState::from_flag(run.shard_optimizer), group.world())?;
    if !group.is_root() {
        crate::QUIET.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    if group.world() > 1 {
        let threads = candle_core::utils::get_num_threads();
        let over = if run.device.is_cuda() { "NCCL" } else { "MPI" };
        crate::say!(
            "data parallel: {} ranks ({over}), {threads} threads each; --batch is per rank",
            group.world()
        );
    }
    Ok(Some((group, device)))
}

/// What `--ranks N` says in a build without `feature` (`mpi` or `nccl`): the build that has it,
/// of the trainer's own package, which its binary `exe` names (`train-bert` is package `bert`).
fn needs_feature(
    ranks: usize,
    device: &crate::DeviceName,
    feature: &str,
    exe: Option<&std::path::Path>,
) -> String {
    let package = exe
        .and_then(|exe| exe.file_stem()?.to_str()?.strip_prefix("train-"))
        .unwrap_or("<the trainer's package>");
    format!(
        "--ranks {ranks} on {device} needs a build with `--features {feature}` (e.g. cargo build \
         --release -p {package} --features {feature})"
    )
}

/// This process's arguments without `--ranks`.
fn own_args() -> Vec<String> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    while let Some(i) = args.iter().position(|a| a == "--ranks" || a.starts_with("--ranks=")) {
        let width = if args[i] == "--ranks" { 2 } else { 1 };
        args.drain(i..(i + width).min(args.len()));
    }
    args
}

/// This process's command line again, without `--ranks`, under `mpirun -np n` ([`mpirun`]).
fn under_mpirun(n: usize) -> Result<std::process::ExitStatus> {
    mpirun(n, &std::env::current_exe()?)
        .args(own_args())
        .status()
        .context("--ranks runs mpirun (Open MPI: apt-get install openmpi-bin libopenmpi-dev)")
}

/// This process's command line again, without `--ranks`, in `n` processes, one per GPU (NCCL,
/// a build with `--features nccl`): `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (the GPU) and the file
/// in which rank 0 leaves NCCL's id. When one fails, the others are ended.
fn one_process_per_gpu(n: usize) -> Result<std::process::ExitStatus> {
    let id_file = std::env::temp_dir().join(format!("nccl-id-{}", std::process::id()));
    std::fs::remove_file(&id_file).ok();
    let exe = std::env::current_exe()?;
    let mut children = (0..n)
        .map(|rank| {
            std::process::Command::new(&exe)
                .args(own_args())
                .envs([
                    ("RANK", rank.to_string()),
                    ("LOCAL_RANK", rank.to_string()),
                    ("WORLD_SIZE", n.to_string()),
                ])
                .env("NCCL_ID_FILE", &id_file)
                .spawn()
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut statuses: Vec<Option<std::process::ExitStatus>> = vec![None; n];
    let outcome = loop {
        for (child, status) in children.iter_mut().zip(&mut statuses) {
            if status.is_none() {
                *status = child.try_wait()?;
            }
        }
        if let Some(failed) = statuses.iter().flatten().find(|s| !s.success()) {
            break *failed;
        }
        if let Some(done) = statuses.iter().all(Option::is_some).then(|| statuses[0]).flatten() {
            break done;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    for (child, status) in children.iter_mut().zip(&statuses) {
        if status.is_none() {
            child.kill().ok();
        }
    }
    std::fs::remove_file(&id_file).ok();
    Ok(outcome)
}

/// `mpirun -np n exe`, to which the caller adds `exe`'s arguments: each rank bound to its share
/// of the cores, and its thread pools (rayon's, and candle's matrix products, which count the
/// machine's cores, not the binding) sized to them by `RAYON_NUM_THREADS` unless already set.
pub fn mpirun(n: usize, exe: &std::path::Path) -> std::process::Command {
    let cores = (candle_core::utils::get_num_threads() / n).max(1);
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| cores.to_string());
    let mut cmd = std::process::Command::new("mpirun");
    cmd.args(["-np", &n.to_string(), "--map-by", &format!("slot:PE={cores}"), "--bind-to", "core"])
        .arg(exe)
        .env("RAYON_NUM_THREADS", threads)
        // mpirun refuses root without these; containers and CI machines run as root.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    cmd
}

/// `result`, except that on a rank of several a failure is printed with the rank and ends every
/// rank (the others would wait for this one in their next all-reduce).
pub fn or_abort(group: &Group, result: Result<()>) -> Result<()> {
    match result {
        Err(e) if group.world() > 1 => {
            // One write: the ranks share stderr, and a line written in pieces interleaves.
            let line = format!("rank {} of {}: error: {e:#}\n", group.rank(), group.world());
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
            group.abort(1)
        }
        other => other,
    }
}

/// Micro-batch `n` of a step whose last is `last`: one forward and backward pass, its gradients
/// added to `grads`. With several ranks the last micro-batch's finished gradients are averaged
/// across them while earlier segments recompute (those of `off`'s single segment after its
/// backward): taken out of the store as they are handed over, summed in f32, divided by the
/// ranks and put back in each gradient's dtype.
pub fn accumulate(
    group: &Group,
    exec: &Executor,
    inputs: &[Tensor],
    n: u64,
    last: u64,
    grads: GradStore,
) -> Result<remat::StepOutput> {
    if group.world() == 1 || n != last {
        return Ok(exec.accumulate(inputs, n, grads)?);
    }
    let params = exec.params();
    let mut started: Vec<Vec<(usize, DType)>> = Vec::new();
    let mut out = exec.accumulate_reporting(inputs, n, grads, &mut |ready, store| {
        let taken: Vec<(usize, Tensor)> =
            ready.iter().filter_map(|&k| Some((k, store.remove(params[k].as_tensor())?))).collect();
        started.push(taken.iter().map(|(k, g)| (*k, g.dtype())).collect());
        group
            .start_mean(taken.into_iter().map(|(_, g)| g).collect())
            .map_err(candle_core::Error::wrap)
    })?;
    for taken in started {
        for ((k, dtype), mean) in taken.into_iter().zip(group.wait_mean()?) {
            out.grads.insert(params[k].as_tensor(), mean.to_dtype(dtype)?);
        }
    }
    Ok(out)
}

/// The plan every rank trains with: rank 0's `resolved` (what the ranks' `requested` policy
/// became). A plan chosen for a budget depends on what each rank measured (stage times, free
/// memory, its share of a sharded optimizer state), and ranks under different plans would start
/// different gradient sums; ranks asked for different policies fail.
pub fn agreed_policy(
    group: &Group,
    requested: &remat::PolicyRequest,
    resolved: remat::Policy,
) -> Result<remat::Policy> {
    if group.world() == 1 {
        return Ok(resolved);
    }
    let theirs: remat::PolicyRequest = broadcast_value(group, requested)?;
    if &theirs != requested {
        bail!(
            "rank {} was given --policy {requested}, rank 0 {theirs}: every rank must checkpoint \
             in sync",
            group.rank()
        );
    }
    broadcast_value(group, &resolved)
}

/// Rank 0's `value`, on every rank: sent as its typed structure (JSON), not as text that each
/// rank would parse again.
fn broadcast_value<T: serde::Serialize + serde::de::DeserializeOwned>(
    group: &Group,
    value: &T,
) -> Result<T> {
    let bytes = group.broadcast_bytes(serde_json::to_vec(value)?, 0)?;
    Ok(serde_json::from_slice(&bytes)?)
}

/// Fails unless every rank holds the same parameter bits (a hash of them, compared by all-reduce).
pub fn check_in_sync(group: &Group, store: &params::ParamStore) -> Result<()> {
    if group.world() == 1 {
        return Ok(());
    }
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for (name, var) in store.named() {
        name.hash(&mut h);
        params::f32_bits(var.as_tensor())?.hash(&mut h);
    }
    if !group.same_everywhere(h.finish())? {
        bail!("the ranks' parameters differ: data-parallel training went out of sync");
    }
    crate::say!("ranks in sync: parameters bit-identical on all {} ranks", group.world());
    Ok(())
}

/// Where the ranks keep the optimizer state (`--shard-optimizer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerState {
    /// Every rank holds all of it and updates every parameter.
    Whole,
    /// ZeRO stage 1: each rank holds and updates its share of the parameters only.
    Sharded,
}

impl OptimizerState {
    /// As `--shard-optimizer` asks.
    pub fn from_flag(shard_optimizer: bool) -> Self {
        if shard_optimizer {
            OptimizerState::Sharded
        } else {
            OptimizerState::Whole
        }
    }
}

/// Refuses `--shard-optimizer` on fewer than two ranks, where it would shard nothing: before
/// anything is built.
pub fn check_sharding(state: OptimizerState, ranks: usize) -> Result<()> {
    if state == OptimizerState::Sharded && ranks < 2 {
        bail!(
            "--shard-optimizer shares the optimizer state among data-parallel ranks: give --ranks \
             N (N > 1)"
        );
    }
    Ok(())
}

/// The run's optimizer over `vars`: `kind`'s, or with its state sharded (`--shard-optimizer`) a
/// [`ShardedOptimizer`] over the ranks of `group`.
pub fn optimizer<'g>(
    state: OptimizerState,
    group: &'g Group,
    kind: OptimizerKind,
    vars: Vec<Var>,
    lr: f64,
) -> Result<Box<dyn TrainOptimizer + 'g>> {
    if state == OptimizerState::Whole {
        return Ok(kind.build(vars, lr)?);
    }
    let sharded = ShardedOptimizer::new(group, kind, vars, lr)?;
    let mine = sharded.state_bytes();
    let total = group.mean_of(mine as f64)? * group.world() as f64;
    let (_, most) = group.min_max(mine)?;
    crate::say!(
        "optimizer state sharded over {} ranks (ZeRO stage 1): {:.1} MiB on the largest share of \
         {:.1} MiB",
        group.world(),
        remat::memory::mib(most),
        remat::memory::mib(total as u64)
    );
    Ok(Box::new(sharded))
}

/// ZeRO stage 1: each rank keeps and updates the optimizer state of its share of the parameters
/// (consecutive parameters holding about 1/N of the bytes); after each update every parameter
/// is broadcast from the rank that updated it, so all ranks hold the same bits, equal to an
/// unsharded run's (the optimizers update each parameter on its own). The gradients are still
/// all-reduced whole (a reduce-scatter would move half as much). The state carries the unsharded
/// optimizer's names, and training snapshots gather it on rank 0: a snapshot resumes on any
/// number of ranks, sharded or not.
pub struct ShardedOptimizer<'g> {
    group: &'g Group,
    /// Over this rank's share, `vars[first..first + count]`.
    inner: Box<dyn TrainOptimizer>,
    vars: Vec<Var>,
    /// The rank that updates each of `vars`.
    owners: Vec<usize>,
    first: usize,
    count: usize,
}

impl<'g> ShardedOptimizer<'g> {
    pub fn new(group: &'g Group, kind: OptimizerKind, vars: Vec<Var>, lr: f64) -> Result<Self> {
        let owners = owners(
            &vars.iter().map(|v| remat::memory::tensor_bytes(v.as_tensor())).collect::<Vec<_>>(),
            group.world(),
        );
        let first = owners.iter().position(|&r| r >= group.rank()).unwrap_or(vars.len());
        let count = owners.iter().filter(|&&r| r == group.rank()).count();
        let inner = kind.build(vars[first..first + count].to_vec(), lr)?;
        Ok(ShardedOptimizer { group, inner, vars, owners, first, count })
    }
}

/// The rank updating each parameter of `bytes` sizes among `world` ranks: consecutive runs, the
/// parameter going to the rank in whose 1/`world` of the total bytes its middle falls.
fn owners(bytes: &[u64], world: usize) -> Vec<usize> {
    let total = bytes.iter().sum::<u64>().max(1) as u128;
    let mut before = 0u64;
    bytes
        .iter()
        .map(|&b| {
            let middle = before as u128 * 2 + b as u128; // twice the middle, to stay in integers
            before += b;
            ((middle * world as u128 / (2 * total)) as usize).min(world - 1)
        })
        .collect()
}

/// `name` with its trailing parameter index (`m.3`) mapped by `index`; `None` where `index`
/// drops it. Names without an index (`step`) are kept.
fn reindexed(name: &str, index: impl Fn(usize) -> Option<usize>) -> Option<String> {
    match name.rsplit_once('.').and_then(|(stem, i)| Some((stem, i.parse::<usize>().ok()?))) {
        Some((stem, i)) => Some(format!("{stem}.{}", index(i)?)),
        None => Some(name.to_string()),
    }
}

impl TrainOptimizer for ShardedOptimizer<'_> {
    fn update(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.inner.update(grads)?;
        for (var, &owner) in self.vars.iter().zip(&self.owners) {
            let updated =
                self.group.broadcast(var.as_tensor(), owner).map_err(candle_core::Error::wrap)?;
            if owner != self.group.rank() {
                var.set(&updated)?;
            }
        }
        Ok(())
    }

    /// This rank's share, under the unsharded names.
    fn state(&self) -> candle_core::Result<HashMap<String, Tensor>> {
        Ok(self
            .inner
            .state()?
            .into_iter()
            .filter_map(|(k, v)| Some((reindexed(&k, |i| Some(self.first + i))?, v)))
            .collect())
    }

    /// Takes this rank's share of a whole state (an unsharded run's, or one gathered on rank 0).
    fn set_state(&mut self, state: &HashMap<String, Tensor>) -> candle_core::Result<()> {
        let (first, count) = (self.first, self.count);
        let mine = state
            .iter()
            .filter_map(|(k, v)| {
                Some((
                    reindexed(k, |i| (first..first + count).contains(&i).then(|| i - first))?,
                    v.clone(),
                ))
            })
            .collect();
        self.inner.set_state(&mine)
    }

    fn state_bytes(&self) -> u64 {
        self.inner.state_bytes()
    }

    fn snapshot_state(&self) -> candle_core::Result<Option<HashMap<String, Tensor>>> {
        let mine = self.state()?;
        let bytes = safetensors::serialize(mine.iter().map(|(k, v)| (k.as_str(), v)), None)
            .map_err(candle_core::Error::wrap)?;
        drop(mine);
        let Some(all) = self.group.gather_bytes(bytes).map_err(candle_core::Error::wrap)? else {
            return Ok(None);
        };
        let mut whole = HashMap::new();
        for bytes in all {
            whole.extend(candle_core::safetensors::load_buffer(&bytes, &candle_core::Device::Cpu)?);
        }
        Ok(Some(whole))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_are_consecutive_and_balanced() {
        assert_eq!(owners(&[10, 10, 10, 10], 2), [0, 0, 1, 1]);
        assert_eq!(owners(&[100, 1, 1, 1, 1], 2), [0, 1, 1, 1, 1]);
        assert_eq!(owners(&[5; 6], 3), [0, 0, 1, 1, 2, 2]);
        assert_eq!(owners(&[1, 2], 4), [0, 2]);
        assert_eq!(owners(&[], 2), Vec::<usize>::new());
    }

    /// A trainer built without MPI names the build of its own package: `train-bert --ranks 2`
    /// suggested `-p gpt2`.
    #[test]
    fn a_build_without_the_feature_names_the_trainers_package() {
        let cpu = crate::DeviceName::Cpu;
        for package in ["gpt2", "bert", "resnet", "unet3d"] {
            let exe = std::path::PathBuf::from(format!("/w/target/release/train-{package}"));
            let said = needs_feature(2, &cpu, "mpi", Some(&exe));
            assert!(
                said.starts_with("--ranks 2 on cpu needs a build with `--features mpi`")
                    && said.contains(&format!("cargo build --release -p {package} --features mpi")),
                "{said}"
            );
        }
        // Another binary's name: no package guessed.
        let said = needs_feature(2, &cpu, "mpi", Some(std::path::Path::new("/usr/bin/trainer")));
        assert!(!said.contains("-p gpt2") && said.contains("--features mpi"), "{said}");
    }

    #[test]
    fn state_names_map_between_shard_and_whole() {
        assert_eq!(reindexed("m.3", |i| Some(i + 10)).as_deref(), Some("m.13"));
        assert_eq!(reindexed("velocity.0", |_| None), None);
        assert_eq!(reindexed("step", |_| None).as_deref(), Some("step"));
    }
}
