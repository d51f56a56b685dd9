//! Chains say how many inputs they take: a loss that needs no targets makes a one-input chain
//! (`StageGraph::chain_with_inputs(1, ..)`), stepped with the batch alone, its gradients under
//! `sqrt` equal to `off`'s and plain candle's bit for bit; `chain` keeps its two.

use candle_core::{Device, Result, Tensor, Var};
use remat::{Executor, Policy, Stage, StageGraph, StageKind};

mod common;
use common::{bits, Dense, SquaredSum};

fn weights() -> Vec<Var> {
    (0..6)
        .map(|i| {
            let v = remat::rng::RngKey::named(i, "w").normal(16 * 16, 0.0, 0.5);
            Var::from_tensor(&Tensor::from_vec(v, (16, 16), &Device::Cpu).unwrap()).unwrap()
        })
        .collect()
}

/// Six dense blocks (dropout on), their loss the mean of the squares: no targets.
fn blocks(ws: &[Var]) -> Vec<Box<dyn Stage>> {
    ws.iter()
        .map(|w| {
            Box::new(Dense { w: w.as_tensor().clone(), kind: StageKind::Block }) as Box<dyn Stage>
        })
        .collect()
}

#[test]
fn a_one_input_chain_runs_without_targets_bit_for_bit() -> Result<()> {
    let ws = weights();
    let graph = StageGraph::chain_with_inputs(1, blocks(&ws), SquaredSum)?;
    assert_eq!(graph.n_inputs(), 1);
    let x = Tensor::from_vec(
        remat::rng::RngKey::named(9, "x").normal(8 * 16, 0.0, 1.0),
        (8, 16),
        &Device::Cpu,
    )?;
    let batch = [x.clone()]; // the batch alone
    let step = |policy: Policy| {
        Executor::new(&graph, &policy, ws.clone(), 0).unwrap().step(&batch, 3).unwrap()
    };
    let off = bits(&step(Policy::Off).grads, &ws);
    let plain = bits(&graph.plain_loss(&batch, 0, 3)?.backward()?, &ws);
    assert!(off == plain, "off: gradients differ from plain candle's");
    assert!(bits(&step(Policy::Sqrt).grads, &ws) == off, "sqrt: gradients differ from off's");
    for units in ["off+units=3", "sqrt+units=2"] {
        let policy = units.parse().unwrap();
        assert!(bits(&step(policy).grads, &ws) == off, "{units}: gradients differ from off's");
    }
    // A dummy second input is now what is refused.
    let err = Executor::new(&graph, &Policy::Off, ws.clone(), 0)
        .unwrap()
        .step(&[x.clone(), x.clone()], 3)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("takes 1 inputs; 2 were given"), "{err}");
    Ok(())
}

#[test]
fn a_chain_takes_the_inputs_it_says() -> Result<()> {
    let ws = weights();
    // `chain`: the batch and the targets, both read by the loss.
    let two = StageGraph::chain(blocks(&ws), SquaredSum)?;
    // Three: the loss reads the last block's output, then inputs 1 and 2.
    let three = StageGraph::chain_with_inputs(3, blocks(&ws), SquaredSum)?;
    for (graph, n) in [(&two, 2), (&three, 3)] {
        assert_eq!(graph.n_inputs(), n);
        let loss = graph.nodes().last().expect("a loss stage");
        let mut expected = vec![graph.nodes()[ws.len() - 1].outputs[0]];
        expected.extend(1..n);
        assert_eq!(loss.inputs, expected);
    }
    let err = StageGraph::chain_with_inputs(0, blocks(&ws), SquaredSum).err().expect("refused");
    assert!(err.to_string().contains("at least one input"), "{err}");
    Ok(())
}
