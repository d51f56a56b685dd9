//! The 3D U-Net of Çiçek et al. (2016) as a `remat` stage graph with skip edges.
//!
//! Analysis path: per level two 3x3x3 convolutions (each followed by a norm and ReLU) doubling the
//! width from `base * 2^l` to `base * 2^(l+1)`, then a 2x2x2 max-pool. Synthesis path: a 2x2x2
//! transposed convolution up, concatenation with the skip tensor of the same level, two 3x3x3
//! convolutions. A 1x1x1 convolution gives per-voxel class scores; the loss is voxel-wise
//! cross-entropy (optionally plus soft Dice).
//!
//! Stages: `enc.l` (blocks), `pool.l` (downsampling stages), `bottom`, `dec.l` (blocks that take
//! the skip tensor of their level as a second input), `head`. A skip tensor is the input of its
//! pool, so `before-downsample` stores exactly the skip tensors.

use candle_core::{DType, Device, Result, Tensor};
use ops::fused::widened;
use ops::{
    conv3d, conv3d_concat, conv_transpose3d_k2s2, max_pool3d_k2s2, BatchNorm, Conv3dGeometry,
    GroupNorm,
};
use params::{Init, ParamStore};
use remat::{Stage, StageCtx, StageGraph, StageKind};

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Norm {
    Batch,
    Group(usize),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Loss {
    CrossEntropy,
    /// Cross-entropy plus soft Dice (1 - mean Dice over classes).
    CrossEntropyDice,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Config {
    /// Width of the first convolution (32 in the paper).
    pub base: usize,
    /// Number of poolings (3 in the paper: four resolution levels).
    pub levels: usize,
    pub in_channels: usize,
    pub classes: usize,
    pub norm: Norm,
    pub loss: Loss,
    /// The dtype activations are stored in (the volume is cast to it on input).
    #[serde(skip)]
    pub dtype: trainable::Precision,
    /// The parameters that do not train (`--freeze`): read through tensors no variable leads
    /// to, so they get no gradient.
    #[serde(skip)]
    pub freeze: params::Freeze,
}

/// The sizes this crate trains: `tiny` for tests, `small`, and Çiçek et al.'s widths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    Tiny,
    Small,
    Cicek,
}

trainable::presets!(Preset, "3D U-Net", [
    Preset::Tiny => "tiny",
    Preset::Small => "small" ("16-32-64-128"),
    Preset::Cicek => "cicek" ("32-64-128-256, 512 at the bottom"),
]);

impl Preset {
    /// The preset with one input channel, three classes (background, sphere, cube), BatchNorm.
    pub fn config(self) -> Config {
        let (base, levels) = match self {
            Preset::Tiny => (4, 2),
            Preset::Small => (16, 3),
            Preset::Cicek => (32, 3),
        };
        Config {
            base,
            levels,
            in_channels: 1,
            classes: 3,
            norm: Norm::Batch,
            loss: Loss::CrossEntropy,
            dtype: trainable::Precision::F32,
            freeze: params::Freeze::default(),
        }
    }
}

enum NormLayer {
    Batch(BatchNorm),
    Group(GroupNorm),
}

/// conv 3x3x3 (no bias: the norm follows) + norm + ReLU.
struct ConvNormRelu {
    weight: Tensor,
    norm: NormLayer,
}

impl ConvNormRelu {
    fn new(
        params: &mut ParamStore,
        cfg: &Config,
        prefix: &str,
        i: usize,
        c_in: usize,
        c_out: usize,
    ) -> Result<Self> {
        let std = (2.0 / (c_in * 27) as f32).sqrt(); // He initialisation
        let weight = params.get(
            &format!("{prefix}.conv{i}.weight"),
            &[c_out, c_in, 3, 3, 3],
            Init::Normal { std },
        )?;
        let name = format!("{prefix}.norm{i}");
        let norm = match cfg.norm {
            Norm::Batch => NormLayer::Batch(BatchNorm::new(params, &name, c_out)?),
            Norm::Group(g) => {
                // Clamping would train another model than the one asked for.
                if g == 0 || !c_out.is_multiple_of(g) {
                    candle_core::bail!(
                        "{g} GroupNorm groups do not divide the {c_out} channels of `{prefix}` \
                         (every level's channels must be a multiple)"
                    )
                }
                NormLayer::Group(GroupNorm::new(params, &name, c_out, g)?)
            }
        };
        Ok(ConvNormRelu { weight, norm })
    }

    /// The convolution alone, on x or with a skip tensor on the concatenation (skip, x):
    /// PyTorch's `cat([skip, x], 1)`, never made.
    fn convolve(&self, x: &Tensor, skip: Option<&Tensor>) -> Result<Tensor> {
        match skip {
            Some(skip) => conv3d_concat(skip, x, &self.weight, Conv3dGeometry::same(3)),
            None => conv3d(x, &self.weight, Conv3dGeometry::same(3)),
        }
    }

    /// The norm and ReLU of the convolution's output y.
    fn normalised(&self, y: &Tensor, ctx: &StageCtx) -> Result<Tensor> {
        match &self.norm {
            NormLayer::Batch(bn) => bn.forward_relu(y, ctx),
            NormLayer::Group(gn) => gn.forward(y)?.relu(),
        }
    }

    /// `next`'s convolution of the norm and ReLU of y, this one's convolution output. After a
    /// BatchNorm one op, which keeps y alone: the ReLU's output, which nothing else reads, never
    /// is.
    fn then_convolved(&self, y: &Tensor, next: &ConvNormRelu, ctx: &StageCtx) -> Result<Tensor> {
        match &self.norm {
            NormLayer::Batch(bn) => {
                bn.forward_relu_conv3d(y, &next.weight, Conv3dGeometry::same(3), ctx)
            }
            NormLayer::Group(_) => next.convolve(&self.normalised(y, ctx)?, None),
        }
    }
}

/// Two conv-norm-ReLU; in the synthesis path first an up-convolution, the first convolution then
/// taking the skip tensor's channels and the up-sampled ones side by side.
pub struct Level {
    name: String,
    kind: StageKind,
    up: Option<(Tensor, Tensor)>,
    convs: [ConvNormRelu; 2],
}

impl Level {
    fn new(
        params: &mut ParamStore,
        cfg: &Config,
        name: &str,
        c_in: usize,
        c_mid: usize,
        c_out: usize,
        up_skip: Option<usize>,
    ) -> Result<Self> {
        let up = match up_skip {
            Some(_) => {
                let std = (1.0 / (c_in * 8) as f32).sqrt();
                let w = params.get(
                    &format!("{name}.up.weight"),
                    &[c_in, c_in, 2, 2, 2],
                    Init::Normal { std },
                )?;
                Some((w, params.get(&format!("{name}.up.bias"), &[c_in], Init::Zeros)?))
            }
            None => None,
        };
        let first_in = c_in + up_skip.unwrap_or(0);
        Ok(Level {
            name: name.to_string(),
            kind: StageKind::Block,
            up,
            convs: [
                ConvNormRelu::new(params, cfg, name, 1, first_in, c_mid)?,
                ConvNormRelu::new(params, cfg, name, 2, c_mid, c_out)?,
            ],
        })
    }
}

impl Stage for Level {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn kind(&self) -> StageKind {
        self.kind
    }
    fn forward(&self, inputs: &[Tensor], ctx: &StageCtx) -> Result<Vec<Tensor>> {
        let [first, second] = &self.convs;
        let y = match &self.up {
            // (N, C, D, H, W) -> (N, C, 2D, 2H, 2W), convolved beside the skip (N, C_s, 2D, 2H,
            // 2W).
            Some((w, b)) => {
                first.convolve(&conv_transpose3d_k2s2(&inputs[0], w, b)?, Some(&inputs[1]))?
            }
            None => first.convolve(&inputs[0], None)?,
        };
        Ok(vec![second.normalised(&first.then_convolved(&y, second, ctx)?, ctx)?])
    }
}

/// 2x2x2 max-pool: a downsampling stage.
pub struct Pool(usize);

impl Stage for Pool {
    fn name(&self) -> String {
        format!("pool.{}", self.0)
    }
    fn kind(&self) -> StageKind {
        StageKind::Downsample
    }
    fn forward(&self, inputs: &[Tensor], _: &StageCtx) -> Result<Vec<Tensor>> {
        Ok(vec![max_pool3d_k2s2(&inputs[0])?])
    }
}

/// 1x1x1 convolution to class scores and the loss. Inputs: features (N, C, D, H, W), labels
/// (N*D*H*W).
pub struct Head {
    weight: Tensor,
    bias: Tensor,
    classes: usize,
    loss: Loss,
}

impl Head {
    /// Per-voxel scores as a volume (N, K, D, H, W), in f32 whatever the compute dtype (as is the
    /// loss): a pointwise convolution, which keeps only its input (a product of the voxels as
    /// (N*D*H*W, C) rows would keep their permuted copy, the size of x).
    pub fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let (weight, bias) = (widened(&self.weight)?, widened(&self.bias)?);
        let scores = conv3d(&x.to_dtype(DType::F32)?, &weight, Conv3dGeometry::same(1))?;
        scores.broadcast_add(&bias.reshape((1, self.classes, 1, 1, 1))?)
    }

    /// Per-voxel scores (N*D*H*W, K).
    fn scores(&self, x: &Tensor) -> Result<Tensor> {
        self.logits(x)?.permute((0, 2, 3, 4, 1))?.reshape(((), self.classes))
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
        let (scores, labels) = (self.scores(&inputs[0])?, &inputs[1]);
        let ce = ops::fused::cross_entropy(&scores, labels, None)?;
        Ok(vec![match self.loss {
            Loss::CrossEntropy => ce,
            Loss::CrossEntropyDice => (ce + soft_dice_loss(&scores, labels, self.classes)?)?,
        }])
    }
}

/// 1 - mean over classes of 2|P∩Y| / (|P| + |Y|), with P the softmax probabilities (N, K).
fn soft_dice_loss(scores: &Tensor, labels: &Tensor, classes: usize) -> Result<Tensor> {
    let p = ops::fused::softmax_last_dim(scores, 1.0, ops::Mask::None)?;
    let ids = Tensor::arange(0u32, classes as u32, scores.device())?.unsqueeze(0)?; // (1, K)
    let y = labels.unsqueeze(1)?.broadcast_eq(&ids)?.to_dtype(p.dtype())?; // one-hot (N, K)
    let inter = (&p * &y)?.sum(0)?;
    let total = (p.sum(0)? + y.sum(0)?)?;
    let dice = ((inter * 2.0)? / (total + 1e-6)?)?;
    dice.mean_all()?.neg()? + 1.0
}

/// A 3D U-Net: parameters, BatchNorm buffers and the stage graph (inputs: volume, labels; output:
/// loss).
pub struct UNet3d {
    pub config: Config,
    params: ParamStore,
    graph: StageGraph,
    head: std::sync::Arc<Head>,
    /// Every stage but the head, with its input and output values, for evaluation.
    stages: Vec<(std::sync::Arc<dyn Stage>, Vec<usize>, usize)>,
}

impl UNet3d {
    pub fn new(config: Config, device: &Device, seed: u64) -> Result<Self> {
        let (b, levels) = (config.base, config.levels);
        if b == 0 || levels == 0 {
            candle_core::bail!("a 3D U-Net needs base >= 1 and levels >= 1")
        }
        let mut params =
            ParamStore::new(device, config.dtype.weights(), seed).freezing(&config.freeze);
        let mut graph = StageGraph::new(2); // values 0: volume, 1: labels
        let mut stages: Vec<(std::sync::Arc<dyn Stage>, Vec<usize>, usize)> = Vec::new();
        let mut add = |graph: &mut StageGraph,
                       stage: std::sync::Arc<dyn Stage>,
                       inputs: Vec<usize>|
         -> Result<usize> {
            let v = graph.add(stage.clone(), &inputs, 1)?[0];
            stages.push((stage, inputs, v));
            Ok(v)
        };
        let (mut x, mut c, mut skips) = (0, config.in_channels, Vec::new());
        for l in 0..levels {
            let (mid, out) = (b << l, b << (l + 1)); // e.g. 32 -> 64
            let enc = Level::new(&mut params, &config, &format!("enc.{l}"), c, mid, out, None)?;
            let skip = add(&mut graph, std::sync::Arc::new(enc), vec![x])?;
            skips.push((skip, out));
            x = add(&mut graph, std::sync::Arc::new(Pool(l)), vec![skip])?;
            c = out;
        }
        // E.g. 256 -> 512.
        let bottom = Level::new(&mut params, &config, "bottom", c, c, 2 * c, None)?;
        x = add(&mut graph, std::sync::Arc::new(bottom), vec![x])?;
        c *= 2;
        for l in (0..levels).rev() {
            let (skip, c_skip) = skips[l];
            let dec = Level::new(
                &mut params,
                &config,
                &format!("dec.{l}"),
                c,
                c_skip,
                c_skip,
                Some(c_skip),
            )?;
            x = add(&mut graph, std::sync::Arc::new(dec), vec![x, skip])?;
            c = c_skip;
        }
        let head = std::sync::Arc::new(Head {
            weight: params.get(
                "head.weight",
                &[config.classes, c, 1, 1, 1],
                Init::Normal { std: (1.0 / c as f32).sqrt() },
            )?,
            bias: params.get("head.bias", &[config.classes], Init::Zeros)?,
            classes: config.classes,
            loss: config.loss,
        });
        let loss = graph.add(head.clone(), &[x, 1], 1)?[0];
        graph.set_output(loss);
        Ok(UNet3d { config, params, graph, head, stages })
    }

    /// Graph inputs: voxels flattened (N, C, S, S, S) and labels (N*S^3). The side must divide by
    /// 2^levels (every pool halves it).
    pub fn inputs(
        &self,
        voxels: &[f32],
        labels: &[u32],
        side: usize,
        device: &Device,
    ) -> Result<Vec<Tensor>> {
        let div = 1 << self.config.levels;
        if side == 0 || !side.is_multiple_of(div) {
            candle_core::bail!("volume side {side} must be a positive multiple of {div} (2^levels)")
        }
        let n = labels.len() / (side * side * side);
        let c = self.config.in_channels;
        let volume = Tensor::from_slice(voxels, (n, c, side, side, side), device)?
            .to_dtype(self.config.dtype.dtype())?;
        Ok(vec![volume, Tensor::from_slice(labels, n * side * side * side, device)?])
    }

    /// Class scores (N, K, D, H, W): in evaluation mode, or in training mode as step `step` of
    /// the executor runs it (`RunMode::Train`: batch statistics, which update the running ones).
    pub fn logits(&self, volume: &Tensor, mode: remat::RunMode) -> Result<Tensor> {
        let mut values = std::collections::HashMap::from([(0, volume.clone())]);
        let mut last = 0;
        for (i, (stage, inputs, output)) in self.stages.iter().enumerate() {
            let ins: Vec<Tensor> = inputs.iter().map(|v| values[v].clone()).collect();
            values.insert(*output, stage.forward(&ins, &mode.ctx(i))?.remove(0));
            last = *output;
        }
        self.head.logits(&values[&last])
    }
}

trainable::model_config!(Config);

impl trainable::Model for UNet3d {
    const KEEPABLE: &'static [remat::keep::OpKind] = &[remat::keep::OpKind::Conv];

    fn parts(&self) -> (&StageGraph, &ParamStore) {
        (&self.graph, &self.params)
    }
}

/// Synthetic cubic volumes with a voxel-wise segmentation.
impl trainable::Benchable for UNet3d {
    type Config = Config;
    type Data = (datasets::volumes::SyntheticVolumes, usize);
    const DOWNSAMPLES: bool = true;

    fn describe_input(side: usize) -> String {
        format!("{side}^3")
    }

    fn step_floor(config: &Config, batch: usize, side: usize) -> (&'static str, Option<u128>) {
        let volumes = (batch as u128)
            .checked_mul(config.in_channels as u128)
            .and_then(|n| n.checked_mul((side as u128).checked_pow(3)?)); // (B, C, D, H, W)
        ("the input volumes", volumes)
    }

    fn build(config: &Config, device: &Device, seed: u64) -> Result<Self> {
        UNet3d::new(config.clone(), device, seed)
    }

    fn synthetic_data(&self, side: usize, seed: u64) -> Result<Self::Data> {
        Ok((datasets::volumes::SyntheticVolumes::new(side, seed), side))
    }

    fn synthetic_inputs(
        &self,
        (data, side): &Self::Data,
        step: u64,
        batch: usize,
        device: &Device,
    ) -> Result<Vec<Tensor>> {
        let (voxels, labels) = data.batch(step, batch);
        self.inputs(&voxels, &labels, *side, device)
    }
}
