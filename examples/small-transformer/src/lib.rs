//! A small GPT written the way candle users write one (candle-nn's `Embedding`, `LayerNorm`,
//! `Linear`), checkpointed with remat: each transformer block is a stage, the embeddings and the
//! head are stages too, and a policy decides which block boundaries are stored.
//!
//! What remat asks of the model, and nothing else: each block implements [`remat::Stage`]
//! (its `forward` takes the block's input and a [`StageCtx`]), and dropout draws its mask from
//! the context ([`StageCtx::dropout`]), so that a recompute draws the same mask.
//!
//! Two candle-nn ops record no backward, so everything before them silently gets no gradient:
//! `LayerNorm::forward` on a contiguous input and `ops::softmax_last_dim`. The model keeps
//! candle-nn's `LayerNorm` for its weights and normalises with `ops::layer_norm_slow` ([`norm`]),
//! and takes `ops::softmax(x, D::Minus1)`.

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{embedding, layer_norm, linear, Embedding, LayerNorm, Linear, VarBuilder, VarMap};
use remat::{Stage, StageCtx, StageGraph, StageKind};

#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub vocab: usize,
    /// Longest sequence (position embeddings).
    pub context: usize,
    pub width: usize,
    pub heads: usize,
    pub layers: usize,
    pub dropout: f32,
}

/// `ln(x)`, differentiably: candle-nn's `LayerNorm::forward` runs a fused op without backward.
pub fn norm(ln: &LayerNorm, x: &Tensor) -> Result<Tensor> {
    let bias = ln.bias().expect("candle_nn::layer_norm makes a bias");
    candle_nn::ops::layer_norm_slow(x, ln.weight(), bias, 1e-5)
}

/// One pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)).
pub struct Block {
    name: String,
    ln1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln2: LayerNorm,
    fc: Linear,
    fc_out: Linear,
    heads: usize,
    dropout: f32,
}

impl Block {
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let c = cfg.width;
        Ok(Block {
            name: vb.prefix(),
            ln1: layer_norm(c, 1e-5, vb.pp("ln1"))?,
            qkv: linear(c, 3 * c, vb.pp("qkv"))?,
            proj: linear(c, c, vb.pp("proj"))?,
            ln2: layer_norm(c, 1e-5, vb.pp("ln2"))?,
            fc: linear(c, 4 * c, vb.pp("fc"))?,
            fc_out: linear(4 * c, c, vb.pp("fc_out"))?,
            heads: cfg.heads,
            dropout: cfg.dropout,
        })
    }

    /// Causal self-attention of x (B, T, C).
    fn attention(&self, x: &Tensor, ctx: &StageCtx) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let hd = c / self.heads;
        // (3, B, H, T, hd)
        let qkv =
            self.qkv.forward(x)?.reshape((b, t, 3, self.heads, hd))?.permute((2, 0, 3, 1, 4))?;
        let (q, k, v) =
            (qkv.get(0)?.contiguous()?, qkv.get(1)?.contiguous()?, qkv.get(2)?.contiguous()?);
        let scores = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?; // (B, H, T, T)
        let future =
            Tensor::tril2(t, DType::U8, x.device())?.eq(0u8)?.broadcast_as(scores.shape())?;
        let scores = future
            .where_cond(&Tensor::full(f32::NEG_INFINITY, scores.shape(), x.device())?, &scores)?;
        let weights = ctx.dropout(&candle_nn::ops::softmax(&scores, D::Minus1)?, self.dropout)?;
        let y = weights.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))?; // (B, T, C)
        ctx.dropout(&self.proj.forward(&y)?, self.dropout)
    }

    fn mlp(&self, x: &Tensor, ctx: &StageCtx) -> Result<Tensor> {
        ctx.dropout(&self.fc_out.forward(&self.fc.forward(x)?.gelu()?)?, self.dropout)
    }
}

impl Stage for Block {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn forward(&self, inputs: &[Tensor], ctx: &StageCtx) -> Result<Vec<Tensor>> {
        let x = &inputs[0]; // (B, T, C)
        let x = (x + self.attention(&norm(&self.ln1, x)?, ctx)?)?;
        let x = (&x + self.mlp(&norm(&self.ln2, &x)?, ctx)?)?;
        Ok(vec![x])
    }
}

/// The model as a stage graph on two inputs, token ids (B, T) and targets (B, T): the
/// embeddings, the blocks, and a head whose output is the mean cross-entropy.
pub fn gpt(cfg: &Config, vb: VarBuilder) -> Result<StageGraph> {
    let (wte, wpe): (Embedding, Embedding) = (
        embedding(cfg.vocab, cfg.width, vb.pp("wte"))?,
        embedding(cfg.context, cfg.width, vb.pp("wpe"))?,
    );
    let p = cfg.dropout;
    let embed = remat::from_fn("embed", StageKind::Other, move |x, ctx| {
        let t = x[0].dim(1)?;
        let positions = wpe.forward(&Tensor::arange(0u32, t as u32, x[0].device())?)?; // (T, C)
        ctx.dropout(&wte.forward(&x[0])?.broadcast_add(&positions)?, p) // (B, T, C)
    });
    let mut stages: Vec<Box<dyn Stage>> = vec![Box::new(embed)];
    for i in 0..cfg.layers {
        stages.push(Box::new(Block::new(cfg, vb.pp(format!("h.{i}")))?));
    }
    let (ln_f, head) = (
        layer_norm(cfg.width, 1e-5, vb.pp("ln_f"))?,
        linear(cfg.width, cfg.vocab, vb.pp("lm_head"))?,
    );
    let loss = remat::from_fn("head", StageKind::Other, move |x, _| {
        let logits = head.forward(&norm(&ln_f, &x[0])?)?; // (B, T, vocab)
        candle_nn::loss::cross_entropy(&logits.flatten_to(1)?, &x[1].flatten_all()?)
    });
    Ok(StageGraph::chain(stages, loss)?)
}

/// A batch of `batch` sequences of `t` tokens drawn from a fixed pattern, and its next tokens.
pub fn batch(
    cfg: &Config,
    batch: usize,
    t: usize,
    step: u64,
    device: &Device,
) -> Result<[Tensor; 2]> {
    let ids: Vec<u32> = (0..batch * (t + 1))
        .map(|i| ((i as u64 * 7 + step * 13 + (i / (t + 1)) as u64 * 3) % cfg.vocab as u64) as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (batch, t + 1), device)?;
    Ok([ids.narrow(1, 0, t)?.contiguous()?, ids.narrow(1, 1, t)?.contiguous()?])
}

/// The model's parameters, made by candle-nn's default initialisers.
pub fn new(cfg: &Config, device: &Device) -> Result<(VarMap, StageGraph)> {
    let varmap = VarMap::new();
    let graph = gpt(cfg, VarBuilder::from_varmap(&varmap, DType::F32, device))?;
    Ok((varmap, graph))
}
