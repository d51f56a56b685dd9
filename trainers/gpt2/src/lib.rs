//! GPT-2 (Radford et al., 2019) at its published sizes, as a `remat` stage chain.
//!
//! The stage graph is `embed -> h.0 -> ... -> h.{L-1} -> head(loss)`; the blocks are what the
//! checkpointing policies count. Pre-LN blocks, causal self-attention (scores, mask, softmax,
//! dropout and the product with v in one fused op: `ops::fused`), GELU (tanh), dropout on the
//! embeddings, the attention probabilities and both residual branches, LM head tied to the token
//! embedding.
//! Parameter names are Hugging Face's (`h.0.attn.c_attn.weight`, ...), so real weights load.
//!
//! Not here: the training loop (`src/main.rs`), data (`datasets`), the engine (`remat`).

use candle_core::{DType, Device, Result, Tensor};
use ops::{dropout, fused, LayerNorm, Linear, WeightLayout};
use params::lora::Lora;
use params::{Init, ParamStore};
use remat::{Signature, Stage, StageCtx, StageGraph, StageKind};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Hyper-parameters, with Hugging Face's `config.json` field names.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    pub vocab_size: usize,
    pub n_positions: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    #[serde(default = "default_pdrop")]
    pub embd_pdrop: f32,
    #[serde(default = "default_pdrop")]
    pub attn_pdrop: f32,
    #[serde(default = "default_pdrop")]
    pub resid_pdrop: f32,
    #[serde(flatten)]
    pub variant: Variant,
    /// The dtype activations are stored in (not in `config.json`: a training choice).
    #[serde(skip)]
    pub dtype: trainable::Precision,
    /// The parameters that do not train (`--freeze`): read through tensors no variable leads
    /// to, so they get no gradient.
    #[serde(skip)]
    pub freeze: params::Freeze,
    /// LoRA adapters beside the layers it targets (`c_attn`, `c_proj`, `c_fc`), every base
    /// parameter frozen (`--lora`).
    #[serde(skip)]
    pub lora: Option<Lora>,
}

/// The `config.json` keys of variants of GPT-2 this crate does not implement, at GPT-2's own
/// values: read so that another value is refused naming the key, not ignored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Variant {
    /// The MLP's activation: GELU's tanh form (`gelu_new`, also called `gelu_pytorch_tanh`).
    pub activation_function: String,
    /// The MLP's width: 4 x n_embd (`null`).
    pub n_inner: Option<usize>,
    pub scale_attn_weights: bool,
    pub scale_attn_by_inverse_layer_idx: bool,
    pub reorder_and_upcast_attn: bool,
    /// The output projection is the token embedding.
    pub tie_word_embeddings: bool,
    pub add_cross_attention: bool,
}

impl Default for Variant {
    fn default() -> Self {
        Variant {
            activation_function: "gelu_new".into(),
            n_inner: None,
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
            reorder_and_upcast_attn: false,
            tie_word_embeddings: true,
            add_cross_attention: false,
        }
    }
}

impl Variant {
    /// Every key at a value this crate implements.
    fn validate(&self, n_embd: usize) -> std::result::Result<(), String> {
        use trainable::check::implemented;
        let tanh = ["gelu_new", "gelu_pytorch_tanh"].map(String::from);
        implemented("activation_function", &self.activation_function, &tanh)?;
        implemented("n_inner", &self.n_inner, &[None, Some(4 * n_embd)])?;
        implemented("scale_attn_weights", &self.scale_attn_weights, &[true])?;
        implemented(
            "scale_attn_by_inverse_layer_idx",
            &self.scale_attn_by_inverse_layer_idx,
            &[false],
        )?;
        implemented("reorder_and_upcast_attn", &self.reorder_and_upcast_attn, &[false])?;
        implemented("tie_word_embeddings", &self.tie_word_embeddings, &[true])?;
        implemented("add_cross_attention", &self.add_cross_attention, &[false])
    }
}

/// The layers LoRA adapts unless told otherwise (`--lora-targets`): every projection of the
/// attention and the MLP.
pub const LORA_TARGETS: [&str; 3] = ["c_attn", "c_proj", "c_fc"];

fn default_eps() -> f64 {
    1e-5
}

fn default_pdrop() -> f32 {
    0.1
}

/// The published sizes, plus `tiny` for tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    Tiny,
    Small,
    Medium,
    Large,
    Xl,
}

trainable::presets!(Preset, "GPT-2", [
    Preset::Tiny => "tiny",
    Preset::Small => "small" ("124M"),
    Preset::Medium => "medium" ("350M"),
    Preset::Large => "large" ("774M"),
    Preset::Xl => "xl" ("1.56B"),
]);

impl Preset {
    pub fn config(self) -> Config {
        let (n_layer, n_embd, n_head) = match self {
            Preset::Tiny => return Config::tiny(4, 64),
            Preset::Small => (12, 768, 12),
            Preset::Medium => (24, 1024, 16),
            Preset::Large => (36, 1280, 20),
            Preset::Xl => (48, 1600, 25),
        };
        Config {
            vocab_size: 50257,
            n_positions: 1024,
            n_embd,
            n_layer,
            n_head,
            ..Config::tiny(0, 0)
        }
    }
}

impl Config {
    /// A byte-vocabulary model of `n_layer` blocks of width `n_embd` (4 heads), dropout 0.1.
    pub fn tiny(n_layer: usize, n_embd: usize) -> Self {
        Config {
            vocab_size: 256,
            n_positions: 256,
            n_embd,
            n_layer,
            n_head: 4,
            layer_norm_epsilon: default_eps(),
            embd_pdrop: 0.1,
            attn_pdrop: 0.1,
            resid_pdrop: 0.1,
            variant: Variant::default(),
            dtype: trainable::Precision::F32,
            freeze: params::Freeze::default(),
            lora: None,
        }
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        use trainable::check;
        check::positive(&[
            ("vocab_size", self.vocab_size),
            ("n_positions", self.n_positions),
            ("n_layer", self.n_layer),
            ("n_embd", self.n_embd),
        ])?;
        check::epsilon(("layer_norm_epsilon", self.layer_norm_epsilon))?;
        check::heads(("n_embd", self.n_embd), ("n_head", self.n_head))?;
        check::probabilities(&[
            ("embd_pdrop", self.embd_pdrop),
            ("attn_pdrop", self.attn_pdrop),
            ("resid_pdrop", self.resid_pdrop),
        ])?;
        self.variant.validate(self.n_embd)?;
        check::lora(self.lora.as_ref())
    }
}

trainable::model_config!(Config, lora_width: n_embd, validate: Config::validate);

/// Token + position embedding, then dropout. Inputs: ids (B, T) u32. Output: (B, T, C).
pub struct Embed {
    wte: Tensor,
    wpe: Tensor,
    pdrop: f32,
    dtype: DType,
}

impl Stage for Embed {
    fn name(&self) -> String {
        "embed".into()
    }
    fn kind(&self) -> StageKind {
        StageKind::Other
    }
    fn forward(&self, inputs: &[Tensor], ctx: &StageCtx) -> Result<Vec<Tensor>> {
        let ids = &inputs[0];
        let t = ids.dim(1)?;
        let tok = ops::fused::embedding(&self.wte, ids)?; // (B, T, C)
        let pos = self.wpe.narrow(0, 0, t)?; // (T, C)

        // Activations from here on are in the compute dtype.
        Ok(vec![dropout(&tok.broadcast_add(&pos)?.to_dtype(self.dtype)?, self.pdrop, ctx)?])
    }
}

/// One pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)).
pub struct Block {
    index: usize,
    ln_1: LayerNorm,
    c_attn: Linear,
    attn_proj: Linear,
    ln_2: LayerNorm,
    c_fc: Linear,
    mlp_proj: Linear,
    n_head: usize,
    attn_pdrop: f32,
    resid_pdrop: f32,
    /// What every block of this configuration shares (the planner measures one of them).
    signature: Signature,
}

impl Block {
    fn new(params: &mut ParamStore, cfg: &Config, index: usize) -> Result<Self> {
        let c = cfg.n_embd;
        let p = format!("h.{index}");
        // GPT-2 scales the init of the projections into the residual stream by 1/sqrt(2L).
        let proj_std = 0.02 / (2.0 * cfg.n_layer as f32).sqrt();
        Ok(Block {
            index,
            ln_1: LayerNorm::new(params, &format!("{p}.ln_1"), c, cfg.layer_norm_epsilon)?,
            c_attn: Linear::new(
                params,
                cfg.lora.as_ref(),
                &format!("{p}.attn.c_attn"),
                (c, 3 * c),
                WeightLayout::InOut,
                0.02,
            )?,
            attn_proj: Linear::new(
                params,
                cfg.lora.as_ref(),
                &format!("{p}.attn.c_proj"),
                (c, c),
                WeightLayout::InOut,
                proj_std,
            )?,
            ln_2: LayerNorm::new(params, &format!("{p}.ln_2"), c, cfg.layer_norm_epsilon)?,
            c_fc: Linear::new(
                params,
                cfg.lora.as_ref(),
                &format!("{p}.mlp.c_fc"),
                (c, 4 * c),
                WeightLayout::InOut,
                0.02,
            )?,
            mlp_proj: Linear::new(
                params,
                cfg.lora.as_ref(),
                &format!("{p}.mlp.c_proj"),
                (4 * c, c),
                WeightLayout::InOut,
                proj_std,
            )?,
            n_head: cfg.n_head,
            attn_pdrop: cfg.attn_pdrop,
            resid_pdrop: cfg.resid_pdrop,
            signature: Signature::of((
                "gpt2 block",
                (c, cfg.n_head, cfg.layer_norm_epsilon.to_bits()),
                (cfg.attn_pdrop.to_bits(), cfg.resid_pdrop.to_bits()),
                cfg.dtype,
                cfg.lora.as_ref().map(Lora::key),
            )),
        })
    }

    fn attention(&self, x: &Tensor, ctx: &StageCtx) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let (nh, hd) = (self.n_head, c / self.n_head);
        let qkv = self.c_attn.forward(x, ctx)?; // (B, T, 3C)
        let head = |i: usize| {
            qkv.narrow(2, i * c, c)?.reshape((b, t, nh, hd))?.transpose(1, 2)?.contiguous()
        }; // (B, nh, T, hd)
        let (q, k, v) = (head(0)?, head(1)?, head(2)?);
        let y = ops::attention(
            (&q, &k, &v),
            1.0 / (hd as f64).sqrt(),
            ops::Mask::Causal,
            None,
            self.attn_pdrop,
            ctx,
        )?; // (B, nh, T, hd), causal
        let y = y.transpose(1, 2)?.reshape((b, t, c))?; // (B, T, C)
        self.attn_proj.forward(&y, ctx)
    }

    fn mlp(&self, x: &Tensor, ctx: &StageCtx) -> Result<Tensor> {
        // The GELU inside the projection's op, so that only its input is kept.
        self.mlp_proj.forward_gelu(&self.c_fc.forward(x, ctx)?, fused::GeluForm::Tanh, ctx)
        // (B, T, 4C) -> (B, T, C)
    }
}

impl Stage for Block {
    fn name(&self) -> String {
        format!("h.{}", self.index)
    }
    fn signature(&self) -> Option<Signature> {
        Some(self.signature.clone())
    }
    fn forward(&self, inputs: &[Tensor], ctx: &StageCtx) -> Result<Vec<Tensor>> {
        let x = &inputs[0]; // (B, T, C)
        let x =
            (x + dropout(&self.attention(&self.ln_1.forward(x)?, ctx)?, self.resid_pdrop, ctx)?)?;
        let x = (&x + dropout(&self.mlp(&self.ln_2.forward(&x)?, ctx)?, self.resid_pdrop, ctx)?)?;
        Ok(vec![x])
    }
}

/// Final LayerNorm, LM head tied to `wte`, mean cross-entropy. Inputs: x (B, T, C), targets (B, T).
pub struct Head {
    ln_f: LayerNorm,
    wte: Tensor,
}

impl Head {
    fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let h = self.ln_f.forward(x)?.reshape((b * t, c))?;
        // (B, T, V)
        fused::linear(&h, &self.wte, None, WeightLayout::OutIn)?.reshape((b, t, ()))
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

/// A GPT-2 model: its parameters and its stage graph (inputs: ids, targets; output: loss).
pub struct Gpt2 {
    pub config: Config,
    params: ParamStore,
    embed: Arc<Embed>,
    blocks: Vec<Arc<Block>>,
    head: Arc<Head>,
    graph: StageGraph,
}

impl Gpt2 {
    /// A freshly initialised model; the same `seed` gives bit-identical weights.
    pub fn new(config: Config, device: &Device, seed: u64) -> Result<Self> {
        config.validate().map_err(candle_core::Error::Msg)?;
        let (c, v) = (config.n_embd, config.vocab_size);
        let freeze = if config.lora.is_some() { Lora::freeze() } else { config.freeze.clone() };
        let mut params = ParamStore::new(device, config.dtype.weights(), seed).freezing(&freeze);
        let wte = params.get("wte.weight", &[v, c], Init::Normal { std: 0.02 })?;
        let wpe = params.get("wpe.weight", &[config.n_positions, c], Init::Normal { std: 0.02 })?;
        let embed = Arc::new(Embed {
            wte: wte.clone(),
            wpe,
            pdrop: config.embd_pdrop,
            dtype: config.dtype.dtype(),
        });
        let blocks = (0..config.n_layer)
            .map(|i| Block::new(&mut params, &config, i).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        let ln_f = LayerNorm::new(&mut params, "ln_f", c, config.layer_norm_epsilon)?;
        let head = Arc::new(Head { ln_f, wte });

        let mut graph = StageGraph::new(2); // values 0: ids, 1: targets
        let mut x = graph.then(embed.clone(), 0)?;
        for b in &blocks {
            x = graph.then(b.clone(), x)?;
        }
        let loss = graph.add(head.clone(), &[x, 1], 1)?[0];
        graph.set_output(loss);
        Ok(Gpt2 { config, params, embed, blocks, head, graph })
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
        if seq > self.config.n_positions {
            candle_core::bail!(
                "sequence length {seq} exceeds the context of {} positions",
                self.config.n_positions
            )
        }
        Ok(vec![
            Tensor::from_slice(ids, (batch, seq), device)?,
            Tensor::from_slice(targets, (batch, seq), device)?,
        ])
    }

    /// Logits (B, T, V) for ids (B, T): in evaluation mode (no dropout), or in training mode with
    /// the dropout masks step `step` of the executor draws (`RunMode::Train`).
    pub fn logits(&self, ids: &Tensor, mode: remat::RunMode) -> Result<Tensor> {
        let mut x = self.embed.forward(std::slice::from_ref(ids), &mode.ctx(0))?.remove(0);
        for (i, b) in self.blocks.iter().enumerate() {
            x = b.forward(&[x], &mode.ctx(i + 1))?.remove(0);
        }
        self.head.logits(&x)
    }
}

impl trainable::Model for Gpt2 {
    const KEEPABLE: &'static [remat::keep::OpKind] =
        &[remat::keep::OpKind::Matmul, remat::keep::OpKind::Attention];

    fn parts(&self) -> (&StageGraph, &ParamStore) {
        (&self.graph, &self.params)
    }

    /// Hugging Face GPT-2 names, with or without the `transformer.` prefix; the tied
    /// `lm_head.weight` and the attention-mask buffers are skipped.
    fn snapshot_name(&self, name: &str) -> Option<String> {
        let name = name.strip_prefix("transformer.").unwrap_or(name);
        let skip = name == "lm_head.weight"
            || name.ends_with(".attn.bias")
            || name.ends_with(".attn.masked_bias");
        (!skip).then(|| name.to_string())
    }

    /// `GPT2LMHeadModel`'s name: under `transformer.`.
    fn published_name(&self, name: &str) -> String {
        format!("transformer.{name}")
    }
}

/// Synthetic text: the byte tokens of a generated corpus, in sequences of the given length.
impl trainable::Benchable for Gpt2 {
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
        Gpt2::new(config.clone(), device, seed)
    }

    /// From the configuration, without building: GPT-2 XL's weights alone are 6.2 GB.
    fn parameter_shapes(config: &Config) -> Result<Vec<Vec<usize>>> {
        let (c, v, n) = (config.n_embd, config.vocab_size, config.n_positions);
        let layer_norm = || [vec![c], vec![c]];
        let conv1d = |n_in: usize, n_out: usize| [vec![n_in, n_out], vec![n_out]];
        let block = || {
            [
                layer_norm(),
                conv1d(c, 3 * c),
                conv1d(c, c),
                layer_norm(),
                conv1d(c, 4 * c),
                conv1d(4 * c, c),
            ]
            .concat()
        };
        let blocks = (0..config.n_layer).flat_map(|_| block());
        Ok([vec![v, c], vec![n, c]].into_iter().chain(blocks).chain(layer_norm()).collect())
    }

    /// From the configuration: A (rank, in) and B (out, rank) beside each targeted layer.
    fn adapter_shapes(config: &Config) -> Result<Vec<Vec<usize>>> {
        let Some(lora) = &config.lora else { return Ok(Vec::new()) };
        let c = config.n_embd;
        let layer = [
            ("attn.c_attn", c, 3 * c),
            ("attn.c_proj", c, c),
            ("mlp.c_fc", c, 4 * c),
            ("mlp.c_proj", 4 * c, c),
        ];
        Ok(lora.adapter_shapes(
            (0..config.n_layer).flat_map(|l| {
                layer.map(|(name, n_in, n_out)| (format!("h.{l}.{name}"), n_in, n_out))
            }),
        ))
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
