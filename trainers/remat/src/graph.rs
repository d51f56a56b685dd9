//! The stage graph: stages in topological order, connected by tensor values.
//!
//! Values `0..n_inputs` are the graph's inputs (token ids, images, targets); every stage output
//! gets the next free id. A chain is the special case where each stage consumes the previous
//! stage's single output; skip edges (U-Net) are values consumed by stages further on.

use crate::stage::{Stage, StageKind};
use crate::{Error, Result};

/// Index of a tensor value flowing through a [`StageGraph`].
pub type ValueId = usize;

pub struct Node {
    pub stage: Box<dyn Stage>,
    pub inputs: Vec<ValueId>,
    pub outputs: Vec<ValueId>,
}

pub struct StageGraph {
    n_inputs: usize,
    n_values: usize,
    nodes: Vec<Node>,
    output: Option<ValueId>,
}

impl StageGraph {
    /// An empty graph with `n_inputs` input values, ids `0..n_inputs`.
    pub fn new(n_inputs: usize) -> Self {
        StageGraph { n_inputs, n_values: n_inputs, nodes: Vec::new(), output: None }
    }

    /// Appends a stage consuming `inputs` and producing `n_outputs` new values, whose ids it
    /// returns. Stages are added in execution order, so the graph is topologically sorted by
    /// construction.
    pub fn add(&mut self, stage: impl Stage + 'static, inputs: &[ValueId], n_outputs: usize) -> Result<Vec<ValueId>> {
        if let Some(&bad) = inputs.iter().find(|&&v| v >= self.n_values) {
            return Err(Error::Graph(format!("stage `{}` consumes value {bad}, which no earlier stage produces", stage.name())));
        }
        let outputs: Vec<ValueId> = (self.n_values..self.n_values + n_outputs).collect();
        self.n_values += n_outputs;
        self.nodes.push(Node { stage: Box::new(stage), inputs: inputs.to_vec(), outputs: outputs.clone() });
        Ok(outputs)
    }

    /// Appends a stage with one input and one output.
    pub fn then(&mut self, stage: impl Stage + 'static, input: ValueId) -> Result<ValueId> {
        Ok(self.add(stage, &[input], 1)?[0])
    }

    /// Marks the value the graph computes: the scalar loss.
    pub fn set_output(&mut self, v: ValueId) {
        self.output = Some(v);
    }

    pub fn output(&self) -> Result<ValueId> {
        self.output.ok_or_else(|| Error::Graph("no output (loss) value set".into()))
    }

    pub fn n_inputs(&self) -> usize {
        self.n_inputs
    }

    pub fn n_values(&self) -> usize {
        self.n_values
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The stage that produces `v`, or `None` for a graph input.
    pub fn producer(&self, v: ValueId) -> Option<usize> {
        (v >= self.n_inputs).then(|| self.nodes.iter().position(|n| n.outputs.contains(&v))).flatten()
    }

    /// Indices of the stages that count as blocks for the policies.
    pub fn blocks(&self) -> Vec<usize> {
        self.stages_of_kind(StageKind::is_block)
    }

    /// Indices of the stages that reduce the spatial size (blocks or pools).
    pub fn downsampling_stages(&self) -> Vec<usize> {
        self.stages_of_kind(StageKind::is_downsample)
    }

    fn stages_of_kind(&self, keep: impl Fn(StageKind) -> bool) -> Vec<usize> {
        self.nodes.iter().enumerate().filter(|(_, n)| keep(n.stage.kind())).map(|(i, _)| i).collect()
    }
}
