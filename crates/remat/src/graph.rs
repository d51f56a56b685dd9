//! The stage graph: stages in topological order, connected by tensor values.
//!
//! Values `0..n_inputs` are the graph's inputs (token ids, images, targets); every stage output
//! gets the next free id. A chain is the special case where each stage consumes the previous
//! stage's single output; skip edges (U-Net) are values consumed by stages further on.

use crate::stage::{Stage, StageCtx, StageKind};
use crate::{Error, Result};
use candle_core::Tensor;

/// Index of a tensor value flowing through a [`StageGraph`].
pub type ValueId = usize;

/// One stage of a graph and the values it reads and writes.
pub struct Node {
    /// The stage.
    pub stage: Box<dyn Stage>,
    /// The values it reads, in the order its `forward` takes them.
    pub inputs: Vec<ValueId>,
    /// The values it produces, in the order its `forward` returns them.
    pub outputs: Vec<ValueId>,
}

/// Stages in execution order, connected by values (see the module documentation).
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
    pub fn add(
        &mut self,
        stage: impl Stage + 'static,
        inputs: &[ValueId],
        n_outputs: usize,
    ) -> Result<Vec<ValueId>> {
        if let Some(&bad) = inputs.iter().find(|&&v| v >= self.n_values) {
            return Err(Error::Graph(format!(
                "stage `{}` consumes value {bad}, which no earlier stage produces",
                stage.name()
            )));
        }
        let outputs: Vec<ValueId> = (self.n_values..self.n_values + n_outputs).collect();
        self.n_values += n_outputs;
        self.nodes.push(Node {
            stage: Box::new(stage),
            inputs: inputs.to_vec(),
            outputs: outputs.clone(),
        });
        Ok(outputs)
    }

    /// A chain: `blocks` one after the other on graph input 0 (the batch), then `loss` on the last
    /// block's output and graph input 1 (the targets), whose output is the graph's loss. A step
    /// takes the two inputs; for a loss that needs no targets, or more inputs than two,
    /// [`StageGraph::chain_with_inputs`].
    pub fn chain(blocks: Vec<Box<dyn Stage>>, loss: impl Stage + 'static) -> Result<Self> {
        Self::chain_with_inputs(2, blocks, loss)
    }

    /// A chain on `n_inputs` graph inputs: `blocks` one after the other on input 0 (the batch),
    /// then `loss` on the last block's output followed by inputs `1..n_inputs` (none for
    /// `n_inputs = 1`: a loss that needs no targets; targets then a mask for 3), whose output is
    /// the graph's loss. A step takes `n_inputs` tensors. `chain` is `chain_with_inputs(2, ..)`.
    pub fn chain_with_inputs(
        n_inputs: usize,
        blocks: Vec<Box<dyn Stage>>,
        loss: impl Stage + 'static,
    ) -> Result<Self> {
        if n_inputs == 0 {
            return Err(Error::Graph(
                "a chain takes at least one input: the batch its first stage reads".into(),
            ));
        }
        let mut graph = StageGraph::new(n_inputs);
        let mut x = 0;
        for block in blocks {
            x = graph.then(block, x)?;
        }
        let loss_inputs: Vec<ValueId> = std::iter::once(x).chain(1..n_inputs).collect();
        let out = graph.add(loss, &loss_inputs, 1)?[0];
        graph.set_output(out);
        Ok(graph)
    }

    /// Appends a stage with one input and one output.
    pub fn then(&mut self, stage: impl Stage + 'static, input: ValueId) -> Result<ValueId> {
        Ok(self.add(stage, &[input], 1)?[0])
    }

    /// Marks the value the graph computes: the scalar loss.
    pub fn set_output(&mut self, v: ValueId) {
        self.output = Some(v);
    }

    /// The loss value, set by [`StageGraph::set_output`].
    pub fn output(&self) -> Result<ValueId> {
        self.output.ok_or_else(|| Error::Graph("no output (loss) value set".into()))
    }

    /// How many graph inputs there are: values `0..n_inputs`.
    pub fn n_inputs(&self) -> usize {
        self.n_inputs
    }

    /// How many values there are: the inputs and every stage output.
    pub fn n_values(&self) -> usize {
        self.n_values
    }

    /// The stages, in execution order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The stage that produces `v`, or `None` for a graph input.
    pub fn producer(&self, v: ValueId) -> Option<usize> {
        (v >= self.n_inputs)
            .then(|| self.nodes.iter().position(|n| n.outputs.contains(&v)))
            .flatten()
    }

    /// The loss computed by plain candle: every stage in order, in training mode, with candle's
    /// whole graph kept, so `loss.backward()` is plain candle's backward. Stage `i` draws the
    /// random keys the executor's forward draws, so this is the reference every policy, `off`
    /// included, must equal bit for bit; it shares no code with the executor.
    pub fn plain_loss(&self, inputs: &[Tensor], seed: u64, step: u64) -> Result<Tensor> {
        self.forward_all(inputs, |i| StageCtx::train(seed, step, i), false)
    }

    /// The loss in evaluation mode (no dropout, BatchNorm on its running statistics, no
    /// statistics updated), for validation: every stage's outputs are detached and dropped after
    /// their last reader, so the heap holds one stage's work and the values that cross it, not
    /// the whole forward pass.
    pub fn eval_loss(&self, inputs: &[Tensor]) -> Result<Tensor> {
        self.forward_all(inputs, |_| StageCtx::eval(), true)
    }

    /// Runs every stage in order with the context `ctx(i)`; `detach` cuts candle's graph at each
    /// stage output. Values are dropped after their last reader.
    fn forward_all(
        &self,
        inputs: &[Tensor],
        ctx: impl Fn(usize) -> StageCtx,
        detach: bool,
    ) -> Result<Tensor> {
        if inputs.len() != self.n_inputs {
            return Err(Error::Inputs { expected: self.n_inputs, got: inputs.len() });
        }
        let output = self.output()?;
        let last_reader = self.last_readers();
        let mut values: Vec<Option<Tensor>> = inputs
            .iter()
            .cloned()
            .map(Some)
            .chain(std::iter::repeat(None))
            .take(self.n_values)
            .collect();
        for (i, node) in self.nodes.iter().enumerate() {
            let missing = |v| {
                Error::Graph(format!(
                    "stage `{}` consumes value {v}, which its producer did not return",
                    node.stage.name()
                ))
            };
            let ins = node
                .inputs
                .iter()
                .map(|&v| values[v].clone().ok_or_else(|| missing(v)))
                .collect::<Result<Vec<Tensor>>>()?;
            for &v in &node.inputs {
                if last_reader[v] == Some(i) && v != output {
                    values[v] = None;
                }
            }
            let outs = node.stage.forward(&ins, &ctx(i)).map_err(|source| Error::Stage {
                stage: i,
                name: node.stage.name(),
                source,
            })?;
            drop(ins);
            for (&v, t) in node.outputs.iter().zip(outs) {
                values[v] = Some(if detach { t.detach() } else { t });
            }
        }
        values[output].clone().ok_or_else(|| Error::Graph("no stage produced the output".into()))
    }

    /// The last stage that reads each value (`None`: no stage does), by value id.
    pub fn last_readers(&self) -> Vec<Option<usize>> {
        let mut last = vec![None; self.n_values];
        for (i, node) in self.nodes.iter().enumerate() {
            for &v in &node.inputs {
                last[v] = Some(i);
            }
        }
        last
    }

    /// Every stage's kind, in order: what the policies cut by.
    pub fn kinds(&self) -> Vec<StageKind> {
        self.nodes.iter().map(|n| n.stage.kind()).collect()
    }

    /// Indices of the stages that count as blocks for the policies.
    pub fn blocks(&self) -> Vec<usize> {
        stages_of_kind(&self.kinds(), StageKind::is_block)
    }

    /// Indices of the stages that reduce the spatial size (blocks or pools).
    pub fn downsampling_stages(&self) -> Vec<usize> {
        stages_of_kind(&self.kinds(), StageKind::is_downsample)
    }
}

/// Indices of the stages whose kind `keep` selects.
pub fn stages_of_kind(kinds: &[StageKind], keep: fn(StageKind) -> bool) -> Vec<usize> {
    kinds.iter().enumerate().filter(|(_, k)| keep(**k)).map(|(i, _)| i).collect()
}
