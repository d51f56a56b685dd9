//! The executor on a DAG with skip edges and a parameter shared across segments: every policy's
//! gradients equal plain candle's bit for bit, with dropout on.

use candle_core::{DType, Device, Result, Tensor, Var};
use remat::{Executor, Policy, Stage, StageCtx, StageGraph, StageKind};

/// tanh(x W) with dropout; several inputs are summed first (a merge point).
struct Dense {
    w: Tensor,
    kind: StageKind,
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

struct SquaredSum;

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

fn weight(seed: u64, n: usize) -> Var {
    let v = remat::rng::RngKey::named(seed, "w").normal(n * n, 0.0, 0.5);
    Var::from_tensor(&Tensor::from_vec(v, (n, n), &Device::Cpu).unwrap()).unwrap()
}

/// A U-Net-shaped graph: e1 -> e2 -> e3(down) -> d2(e3, skip e2) -> d1(d2, skip e1) -> loss,
/// where d1 reuses e1's weight (a parameter shared across segments).
fn graph(ws: &[Var]) -> StageGraph {
    let dense = |i: usize, kind| Dense { w: ws[i].as_tensor().clone(), kind };
    let mut g = StageGraph::new(1);
    let e1 = g.then(dense(0, StageKind::Block), 0).unwrap();
    let e2 = g.then(dense(1, StageKind::DownsampleBlock), e1).unwrap();
    let e3 = g.then(dense(2, StageKind::DownsampleBlock), e2).unwrap();
    let d2 = g.add(dense(3, StageKind::Block), &[e3, e2], 1).unwrap()[0];
    let d1 = g.add(dense(0, StageKind::Block), &[d2, e1], 1).unwrap()[0];
    let loss = g.then(SquaredSum, d1).unwrap();
    g.set_output(loss);
    g
}

fn grads(policy: &str) -> Vec<Vec<u32>> {
    let ws: Vec<Var> = (0..4).map(|i| weight(i, 16)).collect();
    let g = graph(&ws);
    let exec = Executor::new(&g, &policy.parse::<Policy>().unwrap(), ws.clone(), 5).unwrap();
    let x = Tensor::from_vec(remat::rng::RngKey::named(9, "x").normal(8 * 16, 0.0, 1.0), (8, 16), &Device::Cpu).unwrap();
    let out = exec.step(&[x], 0).unwrap();
    ws.iter()
        .map(|w| {
            let g = out.grads.get(w.as_tensor()).expect("every weight gets a gradient");
            g.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
        })
        .collect()
}

#[test]
fn dag_gradients_equal_off_bit_for_bit() {
    let off = grads("off");
    assert!(off.iter().all(|g| g.iter().any(|&b| f32::from_bits(b) != 0.0)));
    for policy in ["sqrt", "every-n=1", "every-two-blocks", "before-downsample", "explicit=1,3"] {
        assert_eq!(grads(policy), off, "{policy}");
    }
}

#[test]
fn skip_values_are_stored_across_segments() {
    let ws: Vec<Var> = (0..4).map(|i| weight(i, 4)).collect();
    let g = graph(&ws);
    let exec = Executor::new(&g, &Policy::BeforeDownsample, ws, 0).unwrap();
    // Segments start at e2 and e3; stored: e1 (input of e2, skip into d1) and e2 (input of e3, skip into d2).
    assert_eq!(exec.segments(), vec![0..1, 1..2, 2..6]);
    assert_eq!(exec.stored_values(), vec![1, 2]);
}
