//! Data parallelism for the trainers: starting the ranks, averaging each step's gradients across
//! them while the executor recomputes, and checking that they stay in sync.

use crate::RunArgs;
use anyhow::{bail, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
pub use collective::Group;
use remat::Executor;

/// The ranks of this run and this rank's device (`--device`; plain `cuda` is the rank's GPU
/// under one process per GPU), made once: an NCCL group works on that device's stream. With
/// `--ranks N` (N > 1) outside a launcher, runs this very command under `mpirun -np N` (or one
/// process per GPU), waits, and returns `None` (the ranks did the work; a failed rank makes this
/// fail). Under a launcher, the launcher's ranks; otherwise one. Every rank but the first is
/// quiet.
pub fn launch(run: &RunArgs) -> Result<Option<(Group, candle_core::Device)>> {
    let device = crate::device(&run.device)?;
    let group = Group::from_launcher(&device)?;
    if run.ranks > 1 && group.world() == 1 {
        let (feature, built) = if run.device.starts_with("cuda") { ("nccl", cfg!(feature = "nccl")) } else { ("mpi", cfg!(feature = "mpi")) };
        if !built {
            bail!(
                "--ranks {} on {} needs a build with `--features {feature}` (e.g. cargo build --release -p gpt2 --features {feature})",
                run.ranks,
                run.device
            );
        }
        let (how, status) = match run.device.starts_with("cuda") {
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
    if !group.is_root() {
        crate::QUIET.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    if group.world() > 1 {
        let threads = candle_core::utils::get_num_threads();
        let over = if run.device.starts_with("cuda") { "NCCL" } else { "MPI" };
        crate::say!("data parallel: {} ranks ({over}), {threads} threads each; --batch is per rank", group.world());
    }
    Ok(Some((group, device)))
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
    mpirun(n, &std::env::current_exe()?).args(own_args()).status().context("--ranks runs mpirun (Open MPI: apt-get install openmpi-bin libopenmpi-dev)")
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
                .envs([("RANK", rank.to_string()), ("LOCAL_RANK", rank.to_string()), ("WORLD_SIZE", n.to_string())])
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
            eprintln!("rank {} of {}: error: {e:#}", group.rank(), group.world());
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
pub fn accumulate(group: &Group, exec: &Executor, inputs: &[Tensor], n: u64, last: u64, grads: GradStore) -> Result<remat::StepOutput> {
    if group.world() == 1 || n != last {
        return Ok(exec.accumulate(inputs, n, grads)?);
    }
    let params = exec.params();
    let mut started: Vec<Vec<(usize, DType)>> = Vec::new();
    let mut out = exec.accumulate_reporting(inputs, n, grads, &mut |ready, store| {
        let taken: Vec<(usize, Tensor)> = ready.iter().filter_map(|&k| Some((k, store.remove(params[k].as_tensor())?))).collect();
        started.push(taken.iter().map(|(k, g)| (*k, g.dtype())).collect());
        group.start_mean(taken.into_iter().map(|(_, g)| g).collect()).map_err(candle_core::Error::wrap)
    })?;
    for taken in started {
        for ((k, dtype), mean) in taken.into_iter().zip(group.wait_mean()?) {
            out.grads.insert(params[k].as_tensor(), mean.to_dtype(dtype)?);
        }
    }
    Ok(out)
}

/// Fails unless every rank holds the same parameter bits (a hash of them, compared by all-reduce).
pub fn check_in_sync(group: &Group, store: &layers::ParamStore) -> Result<()> {
    if group.world() == 1 {
        return Ok(());
    }
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for (name, var) in store.named() {
        name.hash(&mut h);
        layers::f32_bits(var.as_tensor())?.hash(&mut h);
    }
    if !group.same_everywhere(h.finish())? {
        bail!("the ranks' parameters differ: data-parallel training went out of sync");
    }
    crate::say!("ranks in sync: parameters bit-identical on all {} ranks", group.world());
    Ok(())
}
