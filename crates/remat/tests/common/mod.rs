//! Stages shared by the executor's tests on small graphs.

use candle_core::{Result, Tensor};
use remat::{Stage, StageCtx, StageKind};

/// tanh(x W) with dropout; several inputs are summed first (a skip joining).
pub struct Dense {
    pub w: Tensor,
    pub kind: StageKind,
}

impl Stage for Dense {
    fn name(&self) -> String {
        "dense".into()
    }
    fn kind(&self) -> StageKind {
        self.kind
    }
    fn forward(&self, inputs: &[Tensor], ctx: &StageCtx) -> Result<Vec<Tensor>> {
        let mut x = inputs[0].clone();
        for skip in &inputs[1..] {
            x = (x + skip)?;
        }
        let y = x.matmul(&self.w)?.tanh()?;
        let mask = ctx.next_key().dropout_mask(y.elem_count(), 0.2);
        let mask = Tensor::from_vec(mask, y.shape(), y.device())?;
        Ok(vec![(y * mask)?])
    }
}

/// The loss: the mean of the squares.
pub struct SquaredSum;

impl Stage for SquaredSum {
    fn name(&self) -> String {
        "loss".into()
    }
    fn kind(&self) -> StageKind {
        StageKind::Other
    }
    fn forward(&self, inputs: &[Tensor], _: &StageCtx) -> Result<Vec<Tensor>> {
        Ok(vec![inputs[0].sqr()?.mean_all()?])
    }
}
