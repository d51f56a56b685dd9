//! ResNet (He et al., 2016) exactly as torchvision builds it, as a `remat` stage chain.
//!
//! Stem: 7x7/2 conv, BatchNorm, ReLU (stage `stem`), then the 3x3/2 max-pool with padding 1
//! (stage `pool`, a downsampling stage). Four layers of basic (18/34) or bottleneck (50/101/152)
//! blocks, one stage each; the first block of layers 2-4 downsamples (stride 2 on its 3x3 conv,
//! torchvision's v1.5). Head: global average pool, FC, cross-entropy. Checkpoint boundaries are
//! block outputs, after the residual add (the article: merge points must be kept).
//! Parameter names are torchvision's (`layer1.0.conv1.weight`, `bn1.running_mean`, ...).

use candle_core::{DType, Device, Result, Tensor};
use ops::fused::widened;
use ops::{max_pool2d_k3s2p1, BatchNorm};
use params::{Init, ParamStore};
use remat::{Signature, Stage, StageCtx, StageGraph, StageKind};

/// Architecture: block type, blocks per layer, stem width.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Config {
    pub bottleneck: bool,
    pub layers: [usize; 4],
    /// Channels of the stem and of layer 1 (64 in every published ResNet).
    pub width: usize,
    pub classes: usize,
    /// The dtype activations are stored in.
    #[serde(skip)]
    pub dtype: trainable::Precision,
    /// The parameters that do not train (`--freeze`): read through tensors no variable leads
    /// to, so they get no gradient.
    #[serde(skip)]
    pub freeze: params::Freeze,
}

/// The published depths, plus `tiny` for tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    Tiny,
    Resnet18,
    Resnet34,
    Resnet50,
    Resnet101,
    Resnet152,
}

trainable::presets!(Preset, "ResNet", [
    Preset::Tiny => "tiny",
    Preset::Resnet18 => "resnet18",
    Preset::Resnet34 => "resnet34",
    Preset::Resnet50 => "resnet50",
    Preset::Resnet101 => "resnet101",
    Preset::Resnet152 => "resnet152",
]);

impl Preset {
    /// The preset's configuration, with 1000 classes (set `classes` after).
    pub fn config(self) -> Config {
        let (bottleneck, layers, width) = match self {
            Preset::Tiny => (true, [1, 2, 2, 1], 8),
            Preset::Resnet18 => (false, [2, 2, 2, 2], 64),
            Preset::Resnet34 => (false, [3, 4, 6, 3], 64),
            Preset::Resnet50 => (true, [3, 4, 6, 3], 64),
            Preset::Resnet101 => (true, [3, 4, 23, 3], 64),
            Preset::Resnet152 => (true, [3, 8, 36, 3], 64),
        };
        Config {
            bottleneck,
            layers,
            width,
            classes: 1000,
            dtype: trainable::Precision::F32,
            freeze: params::Freeze::default(),
        }
    }
}

/// The side of the last feature map of an `image_size` input: five halvings, each rounding up
/// (the stem's 7x7/2 and the max-pool's 3x3/2, both padded, and the stride-2 first blocks of
/// layers 2-4): 224 gives 7.
pub fn last_map_side(image_size: usize) -> usize {
    (0..5).fold(image_size, |side, _| side.div_ceil(2))
}

/// A convolution's shape: (input channels, output channels, kernel side, stride).
type ConvShape = (usize, usize, usize, usize);

impl Config {
    fn expansion(&self) -> usize {
        if self.bottleneck {
            4
        } else {
            1
        }
    }

    /// Channels of the last block's output, which the head pools and classifies.
    fn features(&self) -> usize {
        (self.width << 3) * self.expansion()
    }

    /// Every block in order: (name, input channels, planes, stride). The first block of layers
    /// 2-4 downsamples.
    fn blocks(&self) -> Vec<(String, usize, usize, usize)> {
        let mut c_in = self.width;
        let mut blocks = Vec::new();
        for (layer, &n) in self.layers.iter().enumerate() {
            let planes = self.width << layer;
            for i in 0..n {
                let stride = if layer > 0 && i == 0 { 2 } else { 1 };
                blocks.push((format!("layer{}.{i}", layer + 1), c_in, planes, stride));
                c_in = planes * self.expansion();
            }
        }
        blocks
    }

    /// A block's convolutions (each followed by a BatchNorm), and its downsampling projection
    /// when its input and output shapes differ.
    fn block_convs(
        &self,
        c_in: usize,
        planes: usize,
        stride: usize,
    ) -> (Vec<ConvShape>, Option<ConvShape>) {
        let c_out = planes * self.expansion();
        let convs = if self.bottleneck {
            vec![(c_in, planes, 1, 1), (planes, planes, 3, stride), (planes, c_out, 1, 1)]
        } else {
            vec![(c_in, planes, 3, stride), (planes, planes, 3, 1)]
        };
        (convs, (stride != 1 || c_in != c_out).then_some((c_in, c_out, 1, stride)))
    }

    /// The shapes of the trainable parameters, without building the model: each convolution's
    /// weight (out, in, k, k) and its BatchNorm's weight and bias, then the classifier's.
    pub fn parameter_shapes(&self) -> Vec<Vec<usize>> {
        let conv_bn =
            |(c_in, c_out, k, _): ConvShape| [vec![c_out, c_in, k, k], vec![c_out], vec![c_out]];
        let blocks = self.blocks().into_iter().flat_map(|(_, c_in, planes, stride)| {
            let (convs, down) = self.block_convs(c_in, planes, stride);
            convs.into_iter().chain(down)
        });
        let fc = [vec![self.classes, self.features()], vec![self.classes]];
        let stem = conv_bn((3, self.width, 7, 2));
        stem.into_iter().chain(blocks.flat_map(conv_bn)).chain(fc).collect()
    }

    /// Trainable parameters, counted from the shapes without building the model.
    pub fn parameter_count(&self) -> usize {
        self.parameter_shapes().iter().map(|s| s.iter().product::<usize>()).sum()
    }
}

/// A bias-free convolution with square kernel.
struct Conv {
    weight: Tensor,
    stride: usize,
    padding: usize,
}

impl Conv {
    fn new(
        params: &mut ParamStore,
        name: &str,
        c_in: usize,
        c_out: usize,
        k: usize,
        stride: usize,
    ) -> Result<Self> {
        // torchvision: kaiming normal, fan_out, ReLU gain.
        let std = (2.0 / (c_out * k * k) as f32).sqrt();
        let weight =
            params.get(&format!("{name}.weight"), &[c_out, c_in, k, k], Init::Normal { std })?;
        Ok(Conv { weight, stride, padding: k / 2 })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ops::conv2d(x, &self.weight, self.padding, self.stride)
    }

    /// Of `relu(bn(x))`, which nothing else reads: kept as x alone (`ops`' one op).
    fn forward_normalised(&self, x: &Tensor, bn: &BatchNorm, ctx: &StageCtx) -> Result<Tensor> {
        bn.forward_relu_conv2d(x, &self.weight, self.padding, self.stride, ctx)
    }
}

/// conv 7x7/2 + BN + ReLU. (B, 3, H, W) -> (B, width, H/2, W/2)
pub struct Stem {
    conv1: Conv,
    bn1: BatchNorm,
    dtype: DType,
}

impl Stage for Stem {
    fn name(&self) -> String {
        "stem".into()
    }
    fn kind(&self) -> StageKind {
        StageKind::Other
    }
    fn forward(&self, inputs: &[Tensor], ctx: &StageCtx) -> Result<Vec<Tensor>> {
        // Activations from here on are in the compute dtype.
        Ok(vec![self
            .bn1
            .forward_relu(&self.conv1.forward(&inputs[0].to_dtype(self.dtype)?)?, ctx)?])
    }
}

/// The stem's 3x3/2 max-pool with padding 1.
pub struct Pool;

impl Stage for Pool {
    fn name(&self) -> String {
        "pool".into()
    }
    fn kind(&self) -> StageKind {
        StageKind::Downsample
    }
    fn forward(&self, inputs: &[Tensor], _: &StageCtx) -> Result<Vec<Tensor>> {
        Ok(vec![max_pool2d_k3s2p1(&inputs[0])?])
    }
}

/// A basic (two 3x3 convs) or bottleneck (1x1, 3x3, 1x1) residual block.
pub struct Block {
    name: String,
    convs: Vec<(Conv, BatchNorm)>,
    downsample: Option<(Conv, BatchNorm)>,
    stride: usize,
    /// What every block of these shapes shares (the planner measures one of them).
    signature: Signature,
}

impl Block {
    fn new(
        params: &mut ParamStore,
        cfg: &Config,
        name: String,
        c_in: usize,
        planes: usize,
        stride: usize,
    ) -> Result<Self> {
        let (shapes, down) = cfg.block_convs(c_in, planes, stride);
        let convs = shapes
            .iter()
            .copied()
            .enumerate()
            .map(|(i, (ci, co, k, s))| {
                let conv = Conv::new(params, &format!("{name}.conv{}", i + 1), ci, co, k, s)?;
                Ok((conv, BatchNorm::new(params, &format!("{name}.bn{}", i + 1), co)?))
            })
            .collect::<Result<Vec<_>>>()?;
        let downsample = match down {
            Some((ci, co, k, s)) => {
                let conv = Conv::new(params, &format!("{name}.downsample.0"), ci, co, k, s)?;
                Some((conv, BatchNorm::new(params, &format!("{name}.downsample.1"), co)?))
            }
            None => None,
        };
        // The shapes decide a block's work; the first block of a layer projects its input.
        let signature = Signature::of(("resnet block", shapes.clone(), down, cfg.dtype));
        Ok(Block { name, convs, downsample, stride, signature })
    }
}

impl Stage for Block {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn signature(&self) -> Option<Signature> {
        Some(self.signature.clone())
    }
    fn kind(&self) -> StageKind {
        if self.stride > 1 {
            StageKind::DownsampleBlock
        } else {
            StageKind::Block
        }
    }
    fn forward(&self, inputs: &[Tensor], ctx: &StageCtx) -> Result<Vec<Tensor>> {
        let x = &inputs[0]; // (B, C_in, H, W)
        let (first, rest) = self.convs.split_first().expect("a block has convolutions");
        // Each convolution's output before its BatchNorm: the next convolution reads the
        // BatchNorm + ReLU of it in one op, which keeps only it.
        let (mut h, mut bn) = (first.0.forward(x)?, &first.1);
        for (conv, next_bn) in rest {
            h = conv.forward_normalised(&h, bn, ctx)?;
            bn = next_bn;
        }
        // The last BatchNorm takes the identity (or the projection, normalised in the same op)
        // and the ReLU after the add.
        Ok(vec![match &self.downsample {
            Some((conv, other)) => bn.forward_pair_relu(&h, other, &conv.forward(x)?, ctx)?,
            None => bn.forward_add_relu(&h, x, ctx)?,
        }])
        // (B, C_out, H / stride, W / stride)
    }
}

/// Global average pool, FC, mean cross-entropy. Inputs: features (B, C, h, w), labels (B).
pub struct Head {
    fc_weight: Tensor,
    fc_bias: Tensor,
}

impl Head {
    fn logits(&self, x: &Tensor) -> Result<Tensor> {
        // Pooled in f32 whatever the compute dtype: the classifier and the loss run in f32 (bf16
        // weights are read widened, their gradients narrowed back).
        let (weight, bias) = (widened(&self.fc_weight)?, widened(&self.fc_bias)?);
        x.to_dtype(DType::F32)?.mean((2, 3))?.matmul(&weight.t()?)?.broadcast_add(&bias)
        // (B, classes)
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
        Ok(vec![ops::fused::cross_entropy(&self.logits(&inputs[0])?, &inputs[1], None)?])
    }
}

/// A ResNet: parameters, BatchNorm buffers and the stage graph (inputs: images, labels; output:
/// loss).
pub struct ResNet {
    pub config: Config,
    params: ParamStore,
    stages: Vec<std::sync::Arc<dyn Stage>>,
    head: std::sync::Arc<Head>,
    graph: StageGraph,
}

impl ResNet {
    pub fn new(config: Config, device: &Device, seed: u64) -> Result<Self> {
        let mut params =
            ParamStore::new(device, config.dtype.weights(), seed).freezing(&config.freeze);
        let w = config.width;
        let stem = Stem {
            conv1: Conv::new(&mut params, "conv1", 3, w, 7, 2)?,
            bn1: BatchNorm::new(&mut params, "bn1", w)?,
            dtype: config.dtype.dtype(),
        };
        let mut stages: Vec<std::sync::Arc<dyn Stage>> =
            vec![std::sync::Arc::new(stem), std::sync::Arc::new(Pool)];
        for (name, c_in, planes, stride) in config.blocks() {
            stages.push(std::sync::Arc::new(Block::new(
                &mut params,
                &config,
                name,
                c_in,
                planes,
                stride,
            )?));
        }
        let c_in = config.features();
        let bound = 1.0 / (c_in as f32).sqrt();
        let head = std::sync::Arc::new(Head {
            fc_weight: params.get(
                "fc.weight",
                &[config.classes, c_in],
                Init::Normal { std: bound },
            )?,
            fc_bias: params.get("fc.bias", &[config.classes], Init::Zeros)?,
        });

        let mut graph = StageGraph::new(2); // values 0: images, 1: labels
        let mut x = 0;
        for s in &stages {
            x = graph.then(s.clone(), x)?;
        }
        let loss = graph.add(head.clone(), &[x, 1], 1)?[0];
        graph.set_output(loss);
        Ok(ResNet { config, params, stages, head, graph })
    }

    /// Graph inputs for a batch: images flattened (B, 3, size, size) and labels.
    pub fn inputs(
        &self,
        images: &[f32],
        labels: &[u32],
        size: usize,
        device: &Device,
    ) -> Result<Vec<Tensor>> {
        let b = labels.len();
        if size < 32 {
            candle_core::bail!(
                "image size {size} is too small: ResNet downsamples 32x, use at least 32"
            )
        }
        Ok(vec![
            Tensor::from_slice(images, (b, 3, size, size), device)?,
            Tensor::from_slice(labels, b, device)?,
        ])
    }

    /// Logits (B, classes): in evaluation mode (running statistics, no updates), or in training
    /// mode as step `step` of the executor runs it (`RunMode::Train`: batch statistics, which
    /// update the running ones).
    pub fn logits(&self, images: &Tensor, mode: remat::RunMode) -> Result<Tensor> {
        let (_, _, h, w) = images.dims4()?;
        if h != w {
            // candle 0.11's conv2d backward mis-shapes inputs whose sides differ in parity under
            // stride 2; training only sees square images, so evaluation does too.
            candle_core::bail!("images must be square, got {h}x{w}")
        }
        let mut x = images.clone();
        for (i, s) in self.stages.iter().enumerate() {
            x = s.forward(&[x], &mode.ctx(i))?.remove(0);
        }
        self.head.logits(&x)
    }
}

trainable::model_config!(Config);

impl trainable::Model for ResNet {
    const KEEPABLE: &'static [remat::keep::OpKind] =
        &[remat::keep::OpKind::Conv, remat::keep::OpKind::Matmul];

    fn parts(&self) -> (&StageGraph, &ParamStore) {
        (&self.graph, &self.params)
    }

    /// torchvision names; the `num_batches_tracked` counters are skipped.
    fn snapshot_name(&self, name: &str) -> Option<String> {
        (!name.ends_with("num_batches_tracked")).then(|| name.to_string())
    }

    /// The classifier: an ImageNet snapshot's has 1000 classes.
    fn task_head(&self, name: &str) -> bool {
        name.starts_with("fc.")
    }
}

/// Synthetic square images of the model's classes; trained with SGD and momentum, as ResNets are.
impl trainable::Benchable for ResNet {
    type Config = Config;
    type Data = (datasets::images::SyntheticImages, usize);
    const DOWNSAMPLES: bool = true;
    const OPTIMIZER: trainable::OptimizerKind = trainable::OptimizerKind::Sgd;

    fn describe_input(size: usize) -> String {
        format!("{size}x{size}")
    }

    fn step_floor(_: &Config, batch: usize, size: usize) -> (&'static str, Option<u128>) {
        let images = (batch as u128)
            .checked_mul(3)
            .and_then(|n| n.checked_mul((size as u128).checked_pow(2)?)); // (B, 3, H, W)
        ("the input images", images)
    }

    fn build(config: &Config, device: &Device, seed: u64) -> Result<Self> {
        ResNet::new(config.clone(), device, seed)
    }

    fn parameter_shapes(config: &Config) -> Result<Vec<Vec<usize>>> {
        Ok(config.parameter_shapes())
    }

    fn synthetic_data(&self, size: usize, seed: u64) -> Result<Self::Data> {
        Ok((datasets::images::SyntheticImages::new(self.config.classes, size, seed), size))
    }

    fn synthetic_inputs(
        &self,
        (data, size): &Self::Data,
        step: u64,
        batch: usize,
        device: &Device,
    ) -> Result<Vec<Tensor>> {
        let (images, labels) = data.batch(step, batch);
        self.inputs(&images, &labels, *size, device)
    }
}
