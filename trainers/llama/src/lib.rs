//! The decoder family Hugging Face's `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`
//! and `Qwen3ForCausalLM` share (Llama 3.x, Mistral, Qwen2.5, Qwen3, SmolLM2), as a `remat`
//! stage chain.
//!
//! The stage graph is `embed -> model.layers.0 -> ... -> head(loss)`; the decoder layers are what
//! the checkpointing policies count. Each layer: x + o_proj(attention(rope(q), rope(k), v)) of
//! RMSNorm(x), then x + down_proj(silu(gate_proj(h)) * up_proj(h)) of RMSNorm(x). Grouped-query
//! attention (`num_key_value_heads`), rotary embeddings (`rope_theta`, Llama 3's `rope_scaling`),
//! bias on q/k/v (Qwen2), RMSNorm of q and k per head (Qwen3), the LM head tied to the token
//! embedding where `tie_word_embeddings` says so. `config.json` is read as those four classes
//! read it ([`config`]); parameter names are Hugging Face's (`model.layers.0.self_attn.q_proj.
//! weight`), so published checkpoints load.
//!
//! Each piece is one of `ops`' fused ops, which keep for backward no more than PyTorch does:
//! RMSNorm keeps its input, the gated product its two operands, attention (grouped-query, the
//! rotary embedding turned inside it) the projections' q, k and v as they come, token by token,
//! K and V never repeated.
//!
//! Not here: the training loop (`src/main.rs`), data (`datasets`), the engine (`remat`).

pub mod config;

pub use config::{Architecture, Config, Preset, Rope, LORA_TARGETS};

use candle_core::{DType, Device, Result, Tensor};
use ops::{fused, Linear, RmsNorm, WeightLayout};
use params::lora::Lora;
use params::{Init, ParamStore};
use remat::{Signature, Stage, StageCtx, StageGraph, StageKind};
use std::sync::Arc;

/// The std of every weight's initialisation (`initializer_range` of the four classes).
const INIT_STD: f32 = 0.02;

/// Token embedding. Inputs: ids (B, T) u32. Output: (B, T, C) in the compute dtype.
pub struct Embed {
    embed_tokens: Tensor,
    dtype: DType,
}

impl Stage for Embed {
    fn name(&self) -> String {
        "embed".into()
    }
    fn kind(&self) -> StageKind {
        StageKind::Other
    }
    fn forward(&self, inputs: &[Tensor], _: &StageCtx) -> Result<Vec<Tensor>> {
        let x = fused::embedding(&self.embed_tokens, &inputs[0])?; // (B, T, C)
        Ok(vec![x.to_dtype(self.dtype)?])
    }
}

/// One decoder layer: x + attention(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)).
pub struct Layer {
    index: usize,
    input_layernorm: RmsNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    /// Qwen3's RMSNorm of each head of q and k, before the rotary embedding.
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    post_attention_layernorm: RmsNorm,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rotary: fused::Rotary,
    attention_dropout: f32,
    /// What every layer of this configuration shares (the planner measures one of them).
    signature: Signature,
}

impl Layer {
    fn new(
        params: &mut ParamStore,
        cfg: &Config,
        index: usize,
        rotary: &fused::Rotary,
    ) -> Result<Self> {
        let (c, hd) = (cfg.hidden_size, cfg.head_dim);
        let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        let p = format!("model.layers.{index}");
        let lora = cfg.lora.as_ref();
        let linear = |params: &mut ParamStore, name: &str, dims, bias: bool| {
            let prefix = format!("{p}.{name}");
            match bias {
                true => Linear::new(params, lora, &prefix, dims, WeightLayout::OutIn, INIT_STD),
                false => {
                    Linear::without_bias(params, lora, &prefix, dims, WeightLayout::OutIn, INIT_STD)
                }
            }
        };
        let qkv_bias = cfg.architecture == Architecture::Qwen2;
        let eps = cfg.rms_norm_eps;
        let head_norm = |params: &mut ParamStore, name: &str| match cfg.architecture {
            Architecture::Qwen3 => {
                RmsNorm::new(params, &format!("{p}.self_attn.{name}"), hd, eps).map(Some)
            }
            _ => Ok(None),
        };
        Ok(Layer {
            index,
            input_layernorm: RmsNorm::new(params, &format!("{p}.input_layernorm"), c, eps)?,
            q_proj: linear(params, "self_attn.q_proj", (c, q), qkv_bias)?,
            k_proj: linear(params, "self_attn.k_proj", (c, kv), qkv_bias)?,
            v_proj: linear(params, "self_attn.v_proj", (c, kv), qkv_bias)?,
            o_proj: linear(params, "self_attn.o_proj", (q, c), false)?,
            q_norm: head_norm(params, "q_norm")?,
            k_norm: head_norm(params, "k_norm")?,
            post_attention_layernorm: RmsNorm::new(
                params,
                &format!("{p}.post_attention_layernorm"),
                c,
                eps,
            )?,
            gate_proj: linear(params, "mlp.gate_proj", (c, cfg.intermediate_size), false)?,
            up_proj: linear(params, "mlp.up_proj", (c, cfg.intermediate_size), false)?,
            down_proj: linear(params, "mlp.down_proj", (cfg.intermediate_size, c), false)?,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: hd,
            rotary: rotary.clone(),
            attention_dropout: cfg.attention_dropout,
            signature: Signature::of((
                "llama layer",
                cfg.architecture,
                (c, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, hd),
                (eps.to_bits(), cfg.attention_dropout.to_bits()),
                cfg.dtype,
                cfg.lora.as_ref().map(Lora::key),
            )),
        })
    }

    /// (B, T, C) -> (B, T, heads, head_dim) of `proj`, normed per head where `norm` is given.
    fn heads_of(
        &self,
        x: &Tensor,
        proj: &Linear,
        heads: usize,
        norm: Option<&RmsNorm>,
        ctx: &StageCtx,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let h = proj.forward(x, ctx)?.reshape((b, t, heads, self.head_dim))?; // (B, T, h, hd)
        match norm {
            Some(norm) => norm.forward(&h),
            None => Ok(h),
        }
    }

    /// `residual + attention(x)`.
    fn attention(&self, x: &Tensor, residual: &Tensor, ctx: &StageCtx) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let q = self.heads_of(x, &self.q_proj, self.heads, self.q_norm.as_ref(), ctx)?;
        let k = self.heads_of(x, &self.k_proj, self.kv_heads, self.k_norm.as_ref(), ctx)?;
        let v = self.heads_of(x, &self.v_proj, self.kv_heads, None, ctx)?;
        // q and k turned by position inside the op; K and V (B, T, kv_heads, hd), each shared by
        // heads / kv_heads query heads, unrepeated. Token by token in and out: no heads-first
        // copy is made (a copy would keep its source alive for backward).
        let y = ops::rotary_attention(
            (&q, &k, &v),
            &self.rotary,
            1.0 / (self.head_dim as f64).sqrt(),
            ops::Mask::Causal,
            self.attention_dropout,
            ctx,
        )?; // (B, T, heads, hd)
        let y = y.reshape((b, t, self.heads * self.head_dim))?;
        self.o_proj.forward_residual(&y, residual, ctx) // (B, T, C)
    }

    /// `residual + mlp(x)`.
    fn mlp(&self, x: &Tensor, residual: &Tensor, ctx: &StageCtx) -> Result<Tensor> {
        let gate = self.gate_proj.forward(x, ctx)?; // (B, T, I)
        let h = fused::silu_mul(&gate, &self.up_proj.forward(x, ctx)?)?; // silu(gate) * up
        self.down_proj.forward_residual(&h, residual, ctx) // (B, T, C)
    }
}

impl Stage for Layer {
    fn name(&self) -> String {
        format!("model.layers.{}", self.index)
    }
    fn signature(&self) -> Option<Signature> {
        Some(self.signature.clone())
    }
    fn forward(&self, inputs: &[Tensor], ctx: &StageCtx) -> Result<Vec<Tensor>> {
        // x (B, T, C); each residual branch's last projection adds the branch to the stream.
        let x = &inputs[0];
        let x = self.attention(&self.input_layernorm.forward(x)?, x, ctx)?;
        let x = self.mlp(&self.post_attention_layernorm.forward(&x)?, &x, ctx)?;
        Ok(vec![x])
    }
}

/// Final RMSNorm, LM head (tied to the token embedding or its own), mean cross-entropy. Inputs:
/// x (B, T, C), targets (B, T).
pub struct Head {
    norm: RmsNorm,
    lm_head: Tensor,
}

impl Head {
    fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let h = self.norm.forward(x)?.reshape((b * t, c))?;
        let w = self.lm_head.to_dtype(h.dtype())?;
        fused::linear(&h, &w, None, WeightLayout::OutIn)?.reshape((b, t, ())) // (B, T, V)
    }
}

impl Stage for Head {
    fn name(&self) -> String {
        "head".into()
    }
    fn kind(&self) -> StageKind {
        StageKind::Other
    }
    fn forward(&self, inputs: &[Tensor], _: &StageCtx) -> Result<Vec<Tensor>> {
        let logits = self.logits(&inputs[0])?.flatten_to(1)?; // (B*T, V)
        Ok(vec![fused::cross_entropy(&logits, &inputs[1].flatten_all()?, None)?])
    }
}

/// A decoder of the Llama family: its parameters and its stage graph (inputs: ids, targets;
/// output: loss).
pub struct Llama {
    pub config: Config,
    params: ParamStore,
    embed: Arc<Embed>,
    layers: Vec<Arc<Layer>>,
    head: Arc<Head>,
    graph: StageGraph,
}

impl Llama {
    /// A freshly initialised model; the same `seed` gives bit-identical weights.
    pub fn new(config: Config, device: &Device, seed: u64) -> Result<Self> {
        config.validate().map_err(candle_core::Error::Msg)?;
        let (c, v) = (config.hidden_size, config.vocab_size);
        let freeze = if config.lora.is_some() { Lora::freeze() } else { config.freeze.clone() };
        let mut params = ParamStore::new(device, config.dtype.weights(), seed).freezing(&freeze);
        let embed_tokens =
            params.get("model.embed_tokens.weight", &[v, c], Init::Normal { std: INIT_STD })?;
        let embed =
            Arc::new(Embed { embed_tokens: embed_tokens.clone(), dtype: config.dtype.dtype() });
        let rotary = fused::Rotary::new(config.rope.inverse_frequencies(config.head_dim));
        let layers = (0..config.num_hidden_layers)
            .map(|i| Layer::new(&mut params, &config, i, &rotary).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(&mut params, "model.norm", c, config.rms_norm_eps)?;
        let lm_head = match config.tie_word_embeddings {
            true => embed_tokens,
            false => params.get("lm_head.weight", &[v, c], Init::Normal { std: INIT_STD })?,
        };
        let head = Arc::new(Head { norm, lm_head });

        let mut graph = StageGraph::new(2); // values 0: ids, 1: targets
        let mut x = graph.then(embed.clone(), 0)?;
        for layer in &layers {
            x = graph.then(layer.clone(), x)?;
        }
        let loss = graph.add(head.clone(), &[x, 1], 1)?[0];
        graph.set_output(loss);
        Ok(Llama { config, params, embed, layers, head, graph })
    }

    /// The graph inputs for a batch of flattened (B*T) ids and targets.
    pub fn inputs(
        &self,
        ids: &[u32],
        targets: &[u32],
        batch: usize,
        seq: usize,
        device: &Device,
    ) -> Result<Vec<Tensor>> {
        Ok(vec![
            Tensor::from_slice(ids, (batch, seq), device)?,
            Tensor::from_slice(targets, (batch, seq), device)?,
        ])
    }

    /// Logits (B, T, V) for ids (B, T): in evaluation mode (no dropout), or in training mode with
    /// the dropout masks step `step` of the executor draws (`RunMode::Train`).
    pub fn logits(&self, ids: &Tensor, mode: remat::RunMode) -> Result<Tensor> {
        let mut x = self.embed.forward(std::slice::from_ref(ids), &mode.ctx(0))?.remove(0);
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&[x], &mode.ctx(i + 1))?.remove(0);
        }
        self.head.logits(&x)
    }
}

impl trainable::Model for Llama {
    const KEEPABLE: &'static [remat::keep::OpKind] =
        &[remat::keep::OpKind::Matmul, remat::keep::OpKind::Attention];

    fn parts(&self) -> (&StageGraph, &ParamStore) {
        (&self.graph, &self.params)
    }

    /// Hugging Face's names as they are; a tied model's `lm_head.weight` (some checkpoints keep
    /// the copy) is the token embedding, skipped.
    fn snapshot_name(&self, name: &str) -> Option<String> {
        let tied = self.config.tie_word_embeddings && name == "lm_head.weight";
        (!tied).then(|| name.to_string())
    }
}

/// Every projection of a model of `config`: its layer name, input and output widths.
fn linears(config: &Config) -> Vec<(String, usize, usize)> {
    let (c, i, hd) = (config.hidden_size, config.intermediate_size, config.head_dim);
    let (q, kv) = (config.num_attention_heads * hd, config.num_key_value_heads * hd);
    let layer = [
        ("self_attn.q_proj", c, q),
        ("self_attn.k_proj", c, kv),
        ("self_attn.v_proj", c, kv),
        ("self_attn.o_proj", q, c),
        ("mlp.gate_proj", c, i),
        ("mlp.up_proj", c, i),
        ("mlp.down_proj", i, c),
    ];
    (0..config.num_hidden_layers)
        .flat_map(|l| {
            layer.map(|(name, n_in, n_out)| (format!("model.layers.{l}.{name}"), n_in, n_out))
        })
        .collect()
}

/// Synthetic text: the byte tokens of a generated corpus, in sequences of the given length.
impl trainable::Benchable for Llama {
    type Config = Config;
    type Data = (datasets::tokens::Batcher, usize);
    const DOWNSAMPLES: bool = false;

    fn describe_input(seq: usize) -> String {
        format!("seq {seq}")
    }

    fn step_floor(config: &Config, batch: usize, seq: usize) -> (&'static str, Option<u128>) {
        let logits = (batch as u128)
            .checked_mul(seq as u128)
            .and_then(|n| n.checked_mul(config.vocab_size as u128)); // (B, T, vocab)
        ("the logits", logits)
    }

    fn build(config: &Config, device: &Device, seed: u64) -> Result<Self> {
        Llama::new(config.clone(), device, seed)
    }

    /// From the configuration, without building: Llama-3.1-8B's weights alone are 16 GB in bf16.
    fn parameter_shapes(config: &Config) -> Result<Vec<Vec<usize>>> {
        let (c, v, hd) = (config.hidden_size, config.vocab_size, config.head_dim);
        let qkv_bias = config.architecture == Architecture::Qwen2;
        let head_norms = match config.architecture {
            Architecture::Qwen3 => vec![vec![hd], vec![hd]],
            _ => vec![],
        };
        let norms = (0..config.num_hidden_layers).flat_map(|_| {
            [vec![vec![c], vec![c]], head_norms.clone()].concat() // the two RMSNorms, q/k norms
        });
        let linears = linears(config).into_iter().flat_map(|(name, n_in, n_out)| {
            let bias = qkv_bias && ["q_proj", "k_proj", "v_proj"].iter().any(|p| name.ends_with(p));
            [vec![n_out, n_in]].into_iter().chain(bias.then(|| vec![n_out]))
        });
        let lm_head = (!config.tie_word_embeddings).then(|| vec![v, c]);
        Ok([vec![v, c]]
            .into_iter()
            .chain(norms)
            .chain(linears)
            .chain([vec![c]])
            .chain(lm_head)
            .collect())
    }

    /// From the configuration: A (rank, in) and B (out, rank) beside each targeted projection.
    fn adapter_shapes(config: &Config) -> Result<Vec<Vec<usize>>> {
        Ok(config.lora.as_ref().map_or_else(Vec::new, |lora| lora.adapter_shapes(linears(config))))
    }

    fn shallow(config: &Config, blocks: usize) -> Option<(Config, usize)> {
        let shallow = Config { num_hidden_layers: blocks, ..config.clone() };
        Some((shallow, config.num_hidden_layers))
    }

    fn synthetic_data(&self, seq: usize, seed: u64) -> Result<Self::Data> {
        let batcher = datasets::tokens::Batcher::synthetic(seq, self.config.vocab_size, seed);
        Ok((batcher.map_err(candle_core::Error::wrap)?, seq))
    }

    fn synthetic_inputs(
        &self,
        (data, seq): &Self::Data,
        step: u64,
        batch: usize,
        device: &Device,
    ) -> Result<Vec<Tensor>> {
        let (ids, targets) = data.batch(step, batch);
        self.inputs(&ids, &targets, batch, *seq, device)
    }
}
