//! The linear layer of the transformers, with a LoRA adapter beside it where one is configured.
//! Not here: the ops it runs (`fused::linear`), the adapter's parameters (`params::lora`), how a
//! weight is stored (`params::WeightLayout`, re-exported at the crate's root).

use crate::fused::{self, LinearInput};
use candle_core::{Result, Tensor};
use params::lora::{Adapter, Lora};
use params::{Init, ParamStore, WeightLayout};
use remat::StageCtx;

/// `x @ W + b`, with a LoRA adapter beside it where the configuration targets the layer.
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    layout: WeightLayout,
    adapter: Option<Adapter>,
}

impl Linear {
    /// The layer `prefix` (`n_in` -> `n_out`) stored as `layout`: its weight drawn from
    /// N(0, `std`), its bias zeros, and its adapter where `lora` targets it.
    pub fn new(
        params: &mut ParamStore,
        lora: Option<&Lora>,
        prefix: &str,
        (n_in, n_out): (usize, usize),
        layout: WeightLayout,
        std: f32,
    ) -> Result<Self> {
        let without = Self::without_bias(params, lora, prefix, (n_in, n_out), layout, std)?;
        let bias = params.get(&format!("{prefix}.bias"), &[n_out], Init::Zeros)?;
        Ok(Linear { bias: Some(bias), ..without })
    }

    /// [`Linear::new`] without a bias (Llama's projections).
    pub fn without_bias(
        params: &mut ParamStore,
        lora: Option<&Lora>,
        prefix: &str,
        (n_in, n_out): (usize, usize),
        layout: WeightLayout,
        std: f32,
    ) -> Result<Self> {
        let shape = match layout {
            WeightLayout::OutIn => [n_out, n_in],
            WeightLayout::InOut => [n_in, n_out],
        };
        Ok(Linear {
            weight: params.get(&format!("{prefix}.weight"), &shape, Init::Normal { std })?,
            bias: None,
            layout,
            adapter: Adapter::of(params, lora, prefix, (n_in, n_out), layout)?,
        })
    }

    /// `r + self.forward(x)`: a residual branch's last layer and the addition that ends it, as one
    /// op where the layer has neither adapter nor bias ([`fused::linear_residual`]: the product
    /// is not kept for backward beside the sum); otherwise the layer, then the addition.
    pub fn forward_residual(&self, x: &Tensor, r: &Tensor, ctx: &StageCtx) -> Result<Tensor> {
        match (&self.adapter, &self.bias) {
            (None, None) => fused::linear_residual(x, &self.weight, r, self.layout),
            _ => r + self.forward(x, ctx)?,
        }
    }

    /// (B, T, in) -> (B, T, out). With an adapter, one op over the frozen base that keeps only
    /// `x` ([`fused::lora_linear`]); a base that trains under an adapter is refused, since that op
    /// gives its weight and bias no gradient (`Lora::freeze` freezes them).
    pub fn forward(&self, x: &Tensor, ctx: &StageCtx) -> Result<Tensor> {
        self.forward_of(x, LinearInput::AsIs, ctx)
    }

    /// `self.forward(gelu(x, form))`, an MLP's second projection: one op (with or without an
    /// adapter) that keeps x and never gelu(x), which its backward makes again
    /// ([`fused::gelu_linear`]).
    pub fn forward_gelu(
        &self,
        x: &Tensor,
        form: fused::GeluForm,
        ctx: &StageCtx,
    ) -> Result<Tensor> {
        self.forward_of(x, LinearInput::Gelu(form), ctx)
    }

    fn forward_of(&self, x: &Tensor, input: LinearInput, ctx: &StageCtx) -> Result<Tensor> {
        let Some(a) = &self.adapter else {
            let (w, b) = (&self.weight, self.bias.as_ref());
            return match input {
                LinearInput::AsIs => fused::linear(x, w, b, self.layout),
                LinearInput::Gelu(form) => fused::gelu_linear(x, form, w, b, self.layout),
            };
        };
        if self.weight.track_op() || self.bias.as_ref().is_some_and(Tensor::track_op) {
            candle_core::bail!(
                "a layer with a LoRA adapter must have its weight and bias frozen (Lora::freeze): \
                 they would get no gradient"
            )
        }
        let dropout = crate::dropout_key(a.dropout, ctx)?.map(|key| (key, a.dropout));
        fused::lora_linear(
            x,
            input,
            (&self.weight, self.bias.as_ref()),
            self.layout,
            (&a.a, &a.b, a.scale),
            dropout,
        )
    }
}
