//! The one interface every model crate implements, so that the trainers and the harness treat
//! models alike: the stage graph, the parameters, and snapshots under the published names.

use crate::params::{ParamStore, SnapshotError};
use remat::StageGraph;
use std::path::Path;

/// What the trainers and the harness need of a model.
pub trait Model {
    /// The stage graph the executor runs (inputs: the batch; output: the loss).
    fn graph(&self) -> &StageGraph;

    /// Parameters and buffers, under the names published checkpoints use.
    fn params(&self) -> &ParamStore;

    /// The name of ours that a published snapshot's tensor `name` loads into, or `None` to skip it
    /// (tied copies, counters, heads the model lacks). Default: the same name.
    fn snapshot_name(&self, name: &str) -> Option<String> {
        Some(name.to_string())
    }

    /// Writes every parameter and buffer as a safetensors snapshot.
    fn save_snapshot(&self, path: &Path) -> Result<(), SnapshotError> {
        self.params().save(path)
    }

    /// Loads a snapshot written by [`Model::save_snapshot`] or published in the model's format;
    /// every parameter and buffer must be found.
    fn load_snapshot(&self, path: &Path) -> Result<(), SnapshotError> {
        self.params().load(path, |name| self.snapshot_name(name))
    }
}
