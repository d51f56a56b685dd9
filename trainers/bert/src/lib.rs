//! BERT (Devlin et al., 2019) for masked-LM training, as a `remat` stage chain.
//!
//! `embeddings -> encoder.layer.0 -> ... -> encoder.layer.{L-1} -> mlm head(loss)`. Post-LN
//! encoder layers, GELU (erf), dropout 0.1 on the embeddings, the attention probabilities and every
//! residual branch; the MLM head (dense, GELU, LayerNorm, decoder tied to the word embeddings)
//! scores only the masked positions. LayerNorm, attention, GELU, the embedding and the
//! cross-entropy are `ops::fused` ops. Parameter names are Hugging Face's `BertForMaskedLM`.
//! This file is the model; BERT's masking and the data are in `data`.

use candle_core::{DType, Device, Result, Tensor};
use ops::{dropout, fused, LayerNorm, Linear, WeightLayout};
use params::lora::Lora;
use params::{Init, ParamStore};
use remat::{Signature, Stage, StageCtx, StageGraph, StageKind};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

mod data;
pub use data::{mask_tokens, MaskedBatch, MlmData, MlmDataError, Specials};

/// Hyper-parameters, with Hugging Face's `config.json` field names.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_type_vocab")]
    pub type_vocab_size: usize,
    #[serde(default = "default_pdrop")]
    pub hidden_dropout_prob: f32,
    #[serde(default = "default_pdrop")]
    pub attention_probs_dropout_prob: f32,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    #[serde(flatten)]
    pub variant: Variant,
    /// The dtype activations are stored in (not in `config.json`: a training choice).
    #[serde(skip)]
    pub dtype: trainable::Precision,
    /// The parameters that do not train (`--freeze`): read through tensors no variable leads
    /// to, so they get no gradient.
    #[serde(skip)]
    pub freeze: params::Freeze,
    /// LoRA adapters beside the layers it targets (`query`, `key`, `value`, `dense`), every
    /// base parameter frozen (`--lora`).
    #[serde(skip)]
    pub lora: Option<Lora>,
}

/// The `config.json` keys of variants of BERT this crate does not implement, at BERT's own
/// values: read so that another value is refused naming the key, not ignored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Variant {
    /// The feed-forward activation: GELU's exact (erf) form.
    pub hidden_act: String,
    /// Learned absolute positions.
    pub position_embedding_type: String,
    pub is_decoder: bool,
    pub add_cross_attention: bool,
    /// The masked-LM decoder is the word embedding.
    pub tie_word_embeddings: bool,
}

impl Default for Variant {
    fn default() -> Self {
        Variant {
            hidden_act: "gelu".into(),
            position_embedding_type: "absolute".into(),
            is_decoder: false,
            add_cross_attention: false,
            tie_word_embeddings: true,
        }
    }
}

impl Variant {
    /// Every key at a value this crate implements.
    fn validate(&self) -> std::result::Result<(), String> {
        use trainable::check::implemented;
        implemented("hidden_act", &self.hidden_act, &["gelu".into()])?;
        let absolute = ["absolute".to_string()];
        implemented("position_embedding_type", &self.position_embedding_type, &absolute)?;
        implemented("is_decoder", &self.is_decoder, &[false])?;
        implemented("add_cross_attention", &self.add_cross_attention, &[false])?;
        implemented("tie_word_embeddings", &self.tie_word_embeddings, &[true])
    }
}

/// The layers LoRA adapts unless told otherwise (`--lora-targets`): the attention's query, key,
/// value and output projections and every other `dense` layer (the feed-forward ones and the
/// masked-LM head's transform, as PEFT's matching gives them).
pub const LORA_TARGETS: [&str; 4] = ["query", "key", "value", "dense"];

fn default_max_pos() -> usize {
    512
}
fn default_type_vocab() -> usize {
    2
}
fn default_pdrop() -> f32 {
    0.1
}
fn default_eps() -> f64 {
    1e-12
}

/// The published sizes, plus `tiny` for tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    Tiny,
    Base,
    Large,
}

trainable::presets!(Preset, "BERT", [
    Preset::Tiny => "tiny",
    Preset::Base => "base" ("110M"),
    Preset::Large => "large" ("340M"),
]);

impl Preset {
    /// `tiny` (tests), `base` (12 x 768), `large` (24 x 1024).
    pub fn config(self) -> Config {
        let (layers, hidden, heads) = match self {
            Preset::Tiny => return Config::tiny(4, 32),
            Preset::Base => (12, 768, 12),
            Preset::Large => (24, 1024, 16),
        };
        Config { vocab_size: 30522, ..Config::sized(layers, hidden, heads) }
    }
}

impl Config {
    /// A small model of `layers` layers of width `hidden` (4 heads) over a 512-word vocabulary.
    pub fn tiny(layers: usize, hidden: usize) -> Self {
        Config { vocab_size: 512, max_position_embeddings: 256, ..Self::sized(layers, hidden, 4) }
    }

    fn sized(layers: usize, hidden: usize, heads: usize) -> Self {
        Config {
            vocab_size: 0,
            hidden_size: hidden,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            intermediate_size: 4 * hidden,
            max_position_embeddings: default_max_pos(),
            type_vocab_size: default_type_vocab(),
            hidden_dropout_prob: default_pdrop(),
            attention_probs_dropout_prob: default_pdrop(),
            layer_norm_eps: default_eps(),
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
            ("max_position_embeddings", self.max_position_embeddings),
            ("num_hidden_layers", self.num_hidden_layers),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("type_vocab_size", self.type_vocab_size),
        ])?;
        check::epsilon(("layer_norm_eps", self.layer_norm_eps))?;
        check::heads(
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
        )?;
        check::probabilities(&[
            ("hidden_dropout_prob", self.hidden_dropout_prob),
            ("attention_probs_dropout_prob", self.attention_probs_dropout_prob),
        ])?;
        self.variant.validate()?;
        check::lora(self.lora.as_ref())
    }
}

trainable::model_config!(Config, lora_width: hidden_size, validate: Config::validate);

/// Word + position + token-type embeddings, LayerNorm, dropout. Inputs: ids (B, T), token types
/// (B, T). Output (B, T, C).
pub struct Embeddings {
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    ln: LayerNorm,
    pdrop: f32,
    dtype: DType,
}

impl Stage for Embeddings {
    fn name(&self) -> String {
        "embeddings".into()
    }
    fn kind(&self) -> StageKind {
        StageKind::Other
    }
    fn forward(&self, inputs: &[Tensor], ctx: &StageCtx) -> Result<Vec<Tensor>> {
        let t = inputs[0].dim(1)?;
        let words = fused::embedding(&self.word, &inputs[0])?; // (B, T, C)
        let pos = self.position.narrow(0, 0, t)?; // (T, C)
        let segments = fused::embedding(&self.token_type, &inputs[1])?; // (B, T, C)

        // Activations from here on are in the compute dtype.
        let x = (words.broadcast_add(&pos)? + segments)?.to_dtype(self.dtype)?;
        Ok(vec![dropout(&self.ln.forward(&x)?, self.pdrop, ctx)?])
    }
}

/// One post-LN encoder layer: LN(x + attn(x)), then LN(h + ffn(h)).
pub struct Layer {
    index: usize,
    query: Linear,
    key: Linear,
    value: Linear,
    attn_out: Linear,
    attn_ln: LayerNorm,
    intermediate: Linear,
    output: Linear,
    output_ln: LayerNorm,
    n_head: usize,
    attn_pdrop: f32,
    hidden_pdrop: f32,
    /// What every layer of this configuration shares (the planner measures one of them).
    signature: Signature,
}

impl Layer {
    fn new(params: &mut ParamStore, cfg: &Config, index: usize) -> Result<Self> {
        let (c, p) = (cfg.hidden_size, format!("bert.encoder.layer.{index}"));
        let eps = cfg.layer_norm_eps;
        Ok(Layer {
            index,
            query: Linear::new(
                params,
                cfg.lora.as_ref(),
                &format!("{p}.attention.self.query"),
                (c, c),
                WeightLayout::OutIn,
                0.02,
            )?,
            key: Linear::new(
                params,
                cfg.lora.as_ref(),
                &format!("{p}.attention.self.key"),
                (c, c),
                WeightLayout::OutIn,
                0.02,
            )?,
            value: Linear::new(
                params,
                cfg.lora.as_ref(),
                &format!("{p}.attention.self.value"),
                (c, c),
                WeightLayout::OutIn,
                0.02,
            )?,
            attn_out: Linear::new(
                params,
                cfg.lora.as_ref(),
                &format!("{p}.attention.output.dense"),
                (c, c),
                WeightLayout::OutIn,
                0.02,
            )?,
            attn_ln: LayerNorm::new(params, &format!("{p}.attention.output.LayerNorm"), c, eps)?,
            intermediate: Linear::new(
                params,
                cfg.lora.as_ref(),
                &format!("{p}.intermediate.dense"),
                (c, cfg.intermediate_size),
                WeightLayout::OutIn,
                0.02,
            )?,
            output: Linear::new(
                params,
                cfg.lora.as_ref(),
                &format!("{p}.output.dense"),
                (cfg.intermediate_size, c),
                WeightLayout::OutIn,
                0.02,
            )?,
            output_ln: LayerNorm::new(params, &format!("{p}.output.LayerNorm"), c, eps)?,
            n_head: cfg.num_attention_heads,
            attn_pdrop: cfg.attention_probs_dropout_prob,
            hidden_pdrop: cfg.hidden_dropout_prob,
            signature: Signature::of((
                "bert layer",
                (c, cfg.intermediate_size, cfg.num_attention_heads, eps.to_bits()),
                (cfg.attention_probs_dropout_prob.to_bits(), cfg.hidden_dropout_prob.to_bits()),
                cfg.dtype,
                cfg.lora.as_ref().map(Lora::key),
            )),
        })
    }

    /// Self-attention over the keys `mask` (B, T) keeps (1; 0 for padding).
    fn attention(&self, x: &Tensor, mask: &Tensor, ctx: &StageCtx) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let (nh, hd) = (self.n_head, c / self.n_head);
        // (B, nh, T, hd)
        let heads =
            |l: &Linear| l.forward(x, ctx)?.reshape((b, t, nh, hd))?.transpose(1, 2)?.contiguous();
        let (q, k, v) = (heads(&self.query)?, heads(&self.key)?, heads(&self.value)?);
        let y = ops::attention(
            (&q, &k, &v),
            1.0 / (hd as f64).sqrt(),
            ops::Mask::None,
            Some(mask),
            self.attn_pdrop,
            ctx,
        )?; // (B, nh, T, hd)
        y.transpose(1, 2)?.reshape((b, t, c)) // (B, T, C)
    }
}

impl Stage for Layer {
    fn name(&self) -> String {
        format!("encoder.layer.{}", self.index)
    }
    fn signature(&self) -> Option<Signature> {
        Some(self.signature.clone())
    }
    fn forward(&self, inputs: &[Tensor], ctx: &StageCtx) -> Result<Vec<Tensor>> {
        let (x, mask) = (&inputs[0], &inputs[1]); // (B, T, C), (B, T)
        let a = dropout(
            &self.attn_out.forward(&self.attention(x, mask, ctx)?, ctx)?,
            self.hidden_pdrop,
            ctx,
        )?;
        let h = self.attn_ln.forward(&(a + x)?)?;
        // (B, T, 4C) -> (B, T, C); the GELU inside the output layer's op, so that only its input
        // is kept
        let f = self.output.forward_gelu(
            &self.intermediate.forward(&h, ctx)?,
            fused::GeluForm::Erf,
            ctx,
        )?;
        let f = dropout(&f, self.hidden_pdrop, ctx)?;
        Ok(vec![self.output_ln.forward(&(f + h)?)?])
    }
}

/// The masked-LM head: dense, GELU, LayerNorm, decoder tied to the word embeddings, and the mean
/// cross-entropy over masked positions. Inputs: x (B, T, C), labels (B*T) u32, weights (B*T) f32
/// (1 at masked positions, 0 elsewhere).
pub struct MlmHead {
    transform: Linear,
    ln: LayerNorm,
    word: Tensor,
    bias: Tensor,
}

impl MlmHead {
    /// Logits (B*T, V) of hidden states (B, T, C).
    fn logits(&self, x: &Tensor, ctx: &StageCtx) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let h = self
            .ln
            .forward(&fused::gelu(&self.transform.forward(x, ctx)?, fused::GeluForm::Erf)?)?
            .reshape((b * t, c))?;
        fused::linear(&h, &self.word, Some(&self.bias), WeightLayout::OutIn) // (B*T, V)
    }
}

impl Stage for MlmHead {
    fn name(&self) -> String {
        "cls.predictions".into()
    }
    fn kind(&self) -> StageKind {
        StageKind::Other
    }
    fn forward(&self, inputs: &[Tensor], ctx: &StageCtx) -> Result<Vec<Tensor>> {
        Ok(vec![fused::cross_entropy(
            &self.logits(&inputs[0], ctx)?,
            &inputs[1],
            Some(&inputs[2]),
        )?])
        // logits (B*T, V)
    }
}

/// A BERT masked-LM model: parameters and the stage graph (inputs: ids, token types, attention
/// mask, labels, weights; output: the loss).
pub struct Bert {
    pub config: Config,
    params: ParamStore,
    embeddings: Arc<Embeddings>,
    layers: Vec<Arc<Layer>>,
    head: Arc<MlmHead>,
    graph: StageGraph,
}

impl Bert {
    pub fn new(config: Config, device: &Device, seed: u64) -> Result<Self> {
        config.validate().map_err(candle_core::Error::Msg)?;
        let (c, eps) = (config.hidden_size, config.layer_norm_eps);
        let freeze = if config.lora.is_some() { Lora::freeze() } else { config.freeze.clone() };
        let mut params = ParamStore::new(device, config.dtype.weights(), seed).freezing(&freeze);
        let word = params.get(
            "bert.embeddings.word_embeddings.weight",
            &[config.vocab_size, c],
            Init::Normal { std: 0.02 },
        )?;
        let embeddings = Arc::new(Embeddings {
            word: word.clone(),
            position: params.get(
                "bert.embeddings.position_embeddings.weight",
                &[config.max_position_embeddings, c],
                Init::Normal { std: 0.02 },
            )?,
            token_type: params.get(
                "bert.embeddings.token_type_embeddings.weight",
                &[config.type_vocab_size, c],
                Init::Normal { std: 0.02 },
            )?,
            ln: LayerNorm::new(&mut params, "bert.embeddings.LayerNorm", c, eps)?,
            pdrop: config.hidden_dropout_prob,
            dtype: config.dtype.dtype(),
        });
        let layers = (0..config.num_hidden_layers)
            .map(|i| Layer::new(&mut params, &config, i).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        let head = Arc::new(MlmHead {
            transform: Linear::new(
                &mut params,
                config.lora.as_ref(),
                "cls.predictions.transform.dense",
                (c, c),
                WeightLayout::OutIn,
                0.02,
            )?,
            ln: LayerNorm::new(&mut params, "cls.predictions.transform.LayerNorm", c, eps)?,
            word,
            bias: params.get("cls.predictions.bias", &[config.vocab_size], Init::Zeros)?,
        });

        // Values 0: ids, 1: token types, 2: attention mask, 3: labels, 4: weights.
        let mut graph = StageGraph::new(5);
        let mut x = graph.add(embeddings.clone(), &[0, 1], 1)?[0];
        for l in &layers {
            x = graph.add(l.clone(), &[x, 2], 1)?[0];
        }
        let loss = graph.add(head.clone(), &[x, 3, 4], 1)?[0];
        graph.set_output(loss);
        Ok(Bert { config, params, embeddings, layers, head, graph })
    }

    /// Graph inputs for a masked batch.
    pub fn inputs(&self, m: &MaskedBatch, device: &Device) -> Result<Vec<Tensor>> {
        let (b, t) = (m.batch, m.seq);
        if t > self.config.max_position_embeddings {
            candle_core::bail!(
                "sequence length {t} exceeds max_position_embeddings ({})",
                self.config.max_position_embeddings
            )
        }
        Ok(vec![
            Tensor::from_slice(&m.input_ids, (b, t), device)?,
            Tensor::from_slice(&m.token_types, (b, t), device)?,
            Tensor::from_slice(&m.attention_mask, (b, t), device)?,
            Tensor::from_slice(&m.labels, b * t, device)?,
            Tensor::from_slice(&m.weights, b * t, device)?,
        ])
    }

    /// The encoder's output, hidden states (B, T, C), for ids (B, T): in evaluation mode (no
    /// dropout), or in training mode with the dropout masks step `step` of the executor draws
    /// (`RunMode::Train`). `token_types` (B, T) default to 0 (every token in segment A);
    /// `attention_mask` (B, T) is 1 for tokens and 0 for padding, which no token attends to
    /// (default: all 1).
    pub fn hidden_states(
        &self,
        ids: &Tensor,
        token_types: Option<&Tensor>,
        attention_mask: Option<&Tensor>,
        mode: remat::RunMode,
    ) -> Result<Tensor> {
        let zeros = ids.zeros_like()?;
        let ones = Tensor::ones(ids.dims(), DType::F32, ids.device())?;
        let mask = attention_mask.unwrap_or(&ones);
        let mut x = self
            .embeddings
            .forward(&[ids.clone(), token_types.unwrap_or(&zeros).clone()], &mode.ctx(0))?
            .remove(0);
        for (i, l) in self.layers.iter().enumerate() {
            x = l.forward(&[x, mask.clone()], &mode.ctx(i + 1))?.remove(0);
        }
        Ok(x)
    }

    /// The masked-LM head's logits (B*T, V) for hidden states (B, T, C), in `mode`.
    pub fn logits(&self, hidden_states: &Tensor, mode: remat::RunMode) -> Result<Tensor> {
        self.head.logits(hidden_states, &mode.ctx(self.layers.len() + 1))
    }
}

impl trainable::Model for Bert {
    const KEEPABLE: &'static [remat::keep::OpKind] =
        &[remat::keep::OpKind::Matmul, remat::keep::OpKind::Attention];

    fn parts(&self) -> (&StageGraph, &ParamStore) {
        (&self.graph, &self.params)
    }

    /// Hugging Face names: `BertForMaskedLM`'s, or a bare `BertModel`'s (no `bert.` prefix), old
    /// `gamma`/`beta` LayerNorm names included. The pooler, the tied decoder copy and
    /// `position_ids` are skipped.
    fn snapshot_name(&self, name: &str) -> Option<String> {
        let skip = name.contains("pooler.")
            || name.ends_with("position_ids")
            || name.starts_with("cls.predictions.decoder.");
        if skip {
            return None;
        }
        let name = name
            .replace("LayerNorm.gamma", "LayerNorm.weight")
            .replace("LayerNorm.beta", "LayerNorm.bias");
        Some(if name.starts_with("embeddings.") || name.starts_with("encoder.") {
            format!("bert.{name}")
        } else {
            name
        })
    }

    /// The masked-LM head (its decoder is the word embeddings): a bare `BertModel` has none.
    fn task_head(&self, name: &str) -> bool {
        name.starts_with("cls.")
    }
}

/// Synthetic masked-LM batches over the whole vocabulary.
impl trainable::Benchable for Bert {
    type Config = Config;
    type Data = MlmData;
    const DOWNSAMPLES: bool = false;

    fn describe_input(seq: usize) -> String {
        format!("seq {seq}")
    }

    fn step_floor(config: &Config, batch: usize, seq: usize) -> (&'static str, Option<u128>) {
        let hidden = (batch as u128)
            .checked_mul(seq as u128)
            .and_then(|n| n.checked_mul(config.hidden_size as u128)); // (B, T, C)
        ("one layer's hidden states", hidden)
    }

    fn build(config: &Config, device: &Device, seed: u64) -> Result<Self> {
        Bert::new(config.clone(), device, seed)
    }

    /// From the configuration, without building (a config.json may describe any size).
    fn parameter_shapes(config: &Config) -> Result<Vec<Vec<usize>>> {
        let (c, i, v) = (config.hidden_size, config.intermediate_size, config.vocab_size);
        let layer_norm = || [vec![c], vec![c]];
        let linear = |n_in: usize, n_out: usize| [vec![n_out, n_in], vec![n_out]]; // (out, in)
        let layer = || {
            [
                linear(c, c), // query
                linear(c, c), // key
                linear(c, c), // value
                linear(c, c), // attention output
                layer_norm(),
                linear(c, i),
                linear(i, c),
                layer_norm(),
            ]
            .concat()
        };
        let embeddings =
            [vec![v, c], vec![config.max_position_embeddings, c], vec![config.type_vocab_size, c]];
        let head = [linear(c, c).to_vec(), layer_norm().to_vec(), vec![vec![v]]].concat();
        Ok(embeddings
            .into_iter()
            .chain(layer_norm())
            .chain((0..config.num_hidden_layers).flat_map(|_| layer()))
            .chain(head)
            .collect())
    }

    fn synthetic_data(&self, seq: usize, seed: u64) -> Result<Self::Data> {
        MlmData::synthetic(self.config.vocab_size, seq, seed).map_err(candle_core::Error::wrap)
    }

    fn synthetic_inputs(
        &self,
        data: &MlmData,
        step: u64,
        batch: usize,
        device: &Device,
    ) -> Result<Vec<Tensor>> {
        self.inputs(&data.batch(step, batch), device)
    }
}
