//! Stages shared by the executor's tests on small graphs.

use candle_core::{CpuStorage, Layout, Result, Shape, Tensor};
use remat::keep::OpKind;
use remat::{Stage, StageCtx, StageKind};
use std::cell::Cell;
use std::sync::Mutex;

thread_local! {
    /// Matrix products computed so far (not replayed) by [`Dense`] stages on this thread (a
    /// test's: the executor runs stages on its caller's thread).
    #[allow(dead_code)] // read by dag.rs, not by every test binary that shares this module
    pub static PRODUCTS: Cell<usize> = const { Cell::new(0) };
}

/// `x @ w` as an op a policy may keep (`+keep=matmul`): computed, or replayed from the forward
/// with the product's backward.
fn keepable_matmul(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    remat::keep::op(OpKind::Matmul, |kept| match kept {
        Some(y) => x.apply_op2(w, Given(Mutex::new(Some(y)))),
        None => {
            PRODUCTS.with(|n| n.set(n.get() + 1));
            x.matmul(w)
        }
    })
}

/// A product whose output is given: its forward copies it, its backward is candle's for matmul.
struct Given(Mutex<Option<Tensor>>);

impl candle_core::CustomOp2 for Given {
    fn name(&self) -> &'static str {
        "given-matmul"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = self.0.lock().unwrap().take().expect("forward runs once");
        let (storage, layout) = y.storage_and_layout();
        let candle_core::Storage::Cpu(s) = &*storage else { candle_core::bail!("CPU only") };
        assert!(layout.is_contiguous() && layout.start_offset() == 0);
        Ok((s.clone(), y.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dx = x.track_op().then(|| g.matmul(&w.t()?)).transpose()?;
        let dw = w.track_op().then(|| x.t()?.matmul(g)).transpose()?;
        Ok((dx, dw))
    }
}

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
        let y = keepable_matmul(&x, &self.w)?.tanh()?;
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

/// Every weight's gradient bits (as f32), in order; each weight must have one.
#[allow(dead_code)] // used by dag.rs and chain.rs, not by every test binary that shares this module
pub fn bits(grads: &candle_core::backprop::GradStore, ws: &[candle_core::Var]) -> Vec<Vec<u32>> {
    ws.iter()
        .map(|w| {
            let g = grads.get(w.as_tensor()).expect("every weight gets a gradient");
            g.to_dtype(candle_core::DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .into_iter()
                .map(f32::to_bits)
                .collect()
        })
        .collect()
}
