//! Scaled dot-product attention with causal mask, key padding, dropout and rotary position
//! embeddings: keeps only q, k, v (scores, probabilities and rotated q and k are rebuilt in
//! backward).

use crate::fused::dropout::DropoutOp;
use crate::fused::dtype::{is_half, widened, widened_as};
use crate::fused::elem::Elem;
use crate::fused::generic::GenericOp;
use crate::fused::op::{exactly, FusedOp, Operand};
use crate::fused::replay::{apply3, kept_or, Replay};
use crate::fused::rotary::{Rotary, Table, Turn};
use crate::fused::route::{generic, lean};
use crate::fused::softmax::{detached, softmax_last_dim, Mask, SoftmaxOp};
use crate::fused::storage::{slice, with_slice};
use candle_core::{CpuStorage, DType, Result, Shape, Tensor};
use remat::keep::OpKind;
use remat::rng::RngKey;
use std::sync::Arc;

/// Scaled dot-product attention of q, k, v (B, heads, T, d): `dropout(softmax(scale q k^T)) v`,
/// with the causal mask if `mask` is [`Mask::Causal`] and dropout by `dropout = (key, p)`. One
/// op: the scores and probabilities are rebuilt in backward (and the dropout mask drawn again from
/// its key), so it keeps nothing but q, k and v, where the composed attention keeps three maps of
/// (B, heads, T, T). `padding` (B, S), nonzero where a key may be attended to (Hugging Face's
/// `attention_mask`), masks the padded keys for every query; a query with no key left gets zeros.
/// Grouped-query attention: k and v may have fewer heads (B, kv_heads, S, d), each shared by
/// `heads / kv_heads` adjacent query heads (Llama's, Qwen's): those queries are attended as rows
/// of one map per key/value head, so K and V are never repeated.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Mask,
    padding: Option<&Tensor>,
    dropout: Option<(RngKey, f32)>,
) -> Result<Tensor> {
    attend(q, k, v, Attending { scale, mask, padding, dropout, rotary: None })
}

/// [`attention`] of q and k turned by the rotary embedding `rotary` first, q's and k's rows at
/// positions 0..T (a decoder's self-attention; no key padding: a causal model's right padding
/// needs none), with q (B, T, heads, d), k and v (B, T, kv_heads, d) and the output (B, T, heads,
/// d) laid out token by token, as the projections give them and the output projection takes
/// them: the op reads and writes that layout itself, so no heads-first copy of q, k, v or of the
/// output is made in candle's graph (each such copy would keep its source alive for backward).
/// The op keeps q and k as given: it turns them again in backward, and turns their gradients
/// back, where rotating them beforehand would keep a rotated copy of each beside the
/// projections' output.
pub fn rotary_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    rotary: &Rotary,
    scale: f64,
    mask: Mask,
    dropout: Option<(RngKey, f32)>,
) -> Result<Tensor> {
    let d = q.dim(3)?;
    if rotary.head_dim() != d {
        candle_core::bail!(
            "rotary attention: heads of {d} features, a rotary embedding of {}",
            rotary.head_dim()
        )
    }
    let how = Attending { scale, mask, padding: None, dropout, rotary: Some(rotary) };
    if !lean(q) {
        let heads_first = |x: &Tensor| x.transpose(1, 2);
        let y = attend(&heads_first(q)?, &heads_first(k)?, &heads_first(v)?, how)?;
        return y.transpose(1, 2)?.contiguous();
    }
    groups(q.dim(2)?, k.dim(2)?, v.dim(2)?)?;
    attention_rows(q, k, v, how, q.dim(1)?, Layout::TokensFirst)
}

/// How many query heads share each key/value head; an error where they cannot share them.
fn groups(heads: usize, kv_heads: usize, v_heads: usize) -> Result<usize> {
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) || v_heads != kv_heads {
        candle_core::bail!(
            "attention: {heads} query heads cannot share {kv_heads} key and {v_heads} value heads"
        )
    }
    Ok(heads / kv_heads)
}

/// How the op's operands and output lie: heads first (B, heads, R, d), the kernels' own layout, or
/// token by token (B, T, heads, d), turned into the kernels' inside the op (a transient copy).
#[derive(Clone, Copy)]
enum Layout {
    HeadsFirst,
    TokensFirst,
}

impl Layout {
    /// q, k, v or the output's gradient as the kernels take them: (B, kv_heads, rows, d), the
    /// query heads that share a key/value head as rows of one map (`kv_heads`: k's heads).
    fn rows(self, x: &Tensor, kv_heads: usize) -> Result<Tensor> {
        match self {
            Layout::HeadsFirst => x.contiguous(),
            Layout::TokensFirst => {
                let (b, t, h, d) = x.dims4()?;
                x.transpose(1, 2)?.contiguous()?.reshape((b, kv_heads, h / kv_heads * t, d))
            }
        }
    }

    /// The heads of k, of shape (B, kv_heads, S, d) or (B, S, kv_heads, d).
    fn kv_heads(self, k: &Shape) -> Result<usize> {
        k.dims4().map(|d| match self {
            Layout::HeadsFirst => d.1,
            Layout::TokensFirst => d.2,
        })
    }

    /// A result in the kernels' layout (B, kv_heads, rows, d') laid out as an operand of shape
    /// `like`.
    fn back(self, x: Tensor, like: &Shape) -> Result<Tensor> {
        match self {
            Layout::HeadsFirst => Ok(x),
            Layout::TokensFirst => {
                let (b, t, h, _) = like.dims4()?;
                x.reshape((b, h, t, x.dim(3)?))?.transpose(1, 2)?.contiguous()
            }
        }
    }
}

/// [`attention`] or [`rotary_attention`], as `how` says.
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, how: Attending) -> Result<Tensor> {
    let (b, heads, t, d) = q.dims4()?;
    let kv_heads = k.dim(1)?;
    if kv_heads == heads {
        return attention_rows(q, k, v, how, t, Layout::HeadsFirst);
    }
    let rep = groups(heads, kv_heads, v.dim(1)?)?;
    // (B, heads, T, d) is (B, kv_heads, heads/kv_heads x T, d) as it lies in memory.
    let grouped = q.contiguous()?.reshape((b, kv_heads, rep * t, d))?;
    let y = attention_rows(&grouped, k, v, how, t, Layout::HeadsFirst)?;
    y.reshape((b, heads, t, ()))
}

/// [`attention`] of q (B, h, R, d) whose rows are queries at positions 0..`period`, repeated
/// every `period` rows (R = period unless grouped-query attention folded heads into the rows), or
/// of q, k, v laid out as `layout` says.
fn attention_rows(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    how: Attending,
    period: usize,
    layout: Layout,
) -> Result<Tensor> {
    // Query rows per batch element, and keys.
    let (b, rows) = (q.dim(0)?, q.dim(1)? * q.dim(2)?);
    let s = match layout {
        Layout::HeadsFirst => k.dim(2)?,
        Layout::TokensFirst => k.dim(1)?,
    };
    if let Some(m) = how.padding {
        if m.dims() != [b, s] {
            candle_core::bail!(
                "attention: the padding mask must be (batch {b}, keys {s}), got {:?}",
                m.dims()
            )
        }
    }
    let turns = how.rotary.map(|r| Turns::new(r, period, s));
    if !lean(q) {
        let (q, k) = match &turns {
            Some(turns) => turns.tensors(q, k, Turn::Forward)?,
            None => (q.clone(), k.clone()),
        };
        let scores = masked(q.matmul(&k.t()?)?, how.padding)?;
        let p = in_blocks(&scores, period, |x| softmax_last_dim(x, how.scale, how.mask))?;
        let p = match how.dropout {
            Some((key, rate)) => crate::fused::dropout::dropout(&p, key, rate)?,
            None => p,
        };
        return p.matmul(v);
    }
    remat::keep::op(OpKind::Attention, |kept| {
        if generic(q) {
            return attention_generic(q, k, v, how, period, turns, layout, kept);
        }
        let padding = match how.padding {
            Some(m) => Some((
                Arc::new(
                    m.to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1::<f32>()?
                        .into_iter()
                        .map(|v| v != 0.0)
                        .collect(),
                ),
                rows,
            )),
            None => None,
        };
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.to_dtype(q.dtype())?.contiguous()?);
        let Attending { scale, mask, dropout, .. } = how;
        let op = AttentionOp { scale, mask, period, padding, dropout, turns, layout };
        apply3(&q, &k, &v, op, kept)
    })
}

/// What [`attention`] does besides its operands.
#[derive(Clone, Copy)]
struct Attending<'a> {
    scale: f64,
    mask: Mask,
    /// (B, S), nonzero where a key may be attended to.
    padding: Option<&'a Tensor>,
    dropout: Option<(RngKey, f32)>,
    rotary: Option<&'a Rotary>,
}

/// Scores (B, h, R, S) with the padded keys at -inf.
fn masked(scores: Tensor, padding: Option<&Tensor>) -> Result<Tensor> {
    let Some(m) = padding else { return Ok(scores) };
    let (b, s) = m.dims2()?;
    let keep = m.ne(0.0)?.reshape((b, 1, 1, s))?.broadcast_as(scores.shape())?;
    let neg_inf = Tensor::new(f32::NEG_INFINITY, scores.device())?
        .to_dtype(scores.dtype())?
        .broadcast_as(scores.shape())?;
    keep.where_cond(&scores, &neg_inf)
}

/// The rotary embedding's turn of q (rows at positions repeating every `q_period`) and k (every
/// `k_period`), from one table of their positions.
#[derive(Clone)]
struct Turns {
    table: Arc<Table>,
    q_period: usize,
    k_period: usize,
}

impl Turns {
    fn new(rotary: &Rotary, q_period: usize, k_period: usize) -> Self {
        Turns { table: Arc::new(rotary.table(q_period.max(k_period))), q_period, k_period }
    }

    /// q and k turned, composed of candle's ops.
    fn tensors(&self, q: &Tensor, k: &Tensor, turn: Turn) -> Result<(Tensor, Tensor)> {
        Ok((
            self.table.rotate_tensor(q, self.q_period, turn)?,
            self.table.rotate_tensor(k, self.k_period, turn)?,
        ))
    }

    /// q and k (CPU, contiguous, in `T`) turned by the kernel.
    fn kernel<T: Elem>(&self, q: &Tensor, k: &Tensor, turn: Turn) -> Result<(Tensor, Tensor)> {
        let turned = |x: &Tensor, period| -> Result<Tensor> {
            let v = with_slice::<T, _>(x, |xs| self.table.rotate(xs, period, turn))?;
            Tensor::from_vec(v, x.shape(), x.device())
        };
        Ok((turned(q, self.q_period)?, turned(k, self.k_period)?))
    }
}

/// `softmax` (`f`) of scores (B, h, R, S) whose rows are queries repeated every `period` rows,
/// each block of `period` rows masked as the first: (B, h, R / period, period, S) for `f`.
fn in_blocks(
    scores: &Tensor,
    period: usize,
    f: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let (b, h, r, s) = scores.dims4()?;
    if r == period {
        return f(scores);
    }
    f(&scores.reshape((b, h, r / period, period, s))?)?.reshape((b, h, r, s))
}

/// The probabilities `softmax(scale q k^T)` of detached q and k (padded keys and, with
/// [`Mask::Causal`], future keys at 0; q's rows repeat their positions every `period` rows) and
/// the dropout mask (scaled by 1 / (1 - rate)) applied to them, from candle's ops.
fn probabilities(
    q: &Tensor,
    k: &Tensor,
    how: Attending,
    period: usize,
) -> Result<(Tensor, Option<Tensor>)> {
    let scores = masked(q.matmul(&k.t()?)?, how.padding)?;
    let p = in_blocks(&scores, period, |x| detached(x, how.scale, how.mask))?;
    drop(scores);
    let mask = match how.dropout {
        Some((key, rate)) => Some(key.dropout_mask_like(&p, rate)?),
        None => None,
    };
    Ok((p, mask))
}

/// The generic route ([`super::generic`]): attention composed on detached q, k, v (q and k turned
/// by `turns` first); backward rebuilds the turned q and k, the probabilities and the dropout
/// mask, so the op keeps only q, k and v, as they lie (`layout`). `kept`: its output, kept from
/// the forward (`remat::keep`).
#[allow(clippy::too_many_arguments)]
fn attention_generic(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    how: Attending,
    period: usize,
    turns: Option<Turns>,
    layout: Layout,
    kept: Option<Tensor>,
) -> Result<Tensor> {
    let padding = how.padding.map(|m| m.detach());
    let Attending { scale, mask, dropout, .. } = how;
    // What the closures need of `how`; the padding is theirs (detached).
    let plain = Attending { scale, mask, padding: None, dropout, rotary: None };
    let back_turns = turns.clone();
    // q and k in f32 for half precision, turned where the embedding is rotary.
    let operands = move |q: &Tensor, k: &Tensor| -> Result<(Tensor, Tensor)> {
        let (q, k) = (widened(q)?, widened(k)?);
        match &turns {
            Some(turns) => turns.tensors(&q, &k, Turn::Forward),
            None => Ok((q, k)),
        }
    };
    let y = kept_or(kept, || {
        // Stored in q's dtype, as the kernel.
        let kv = layout.kv_heads(k.shape())?;
        let (qt, kt) = operands(&layout.rows(&q.detach(), kv)?, &layout.rows(&k.detach(), kv)?)?;
        let (p, mask) =
            probabilities(&qt, &kt, Attending { padding: padding.as_ref(), ..plain }, period)?;
        let pd = match &mask {
            Some(m) => (p * m)?,
            None => p,
        };
        let v = widened_as(&layout.rows(&v.detach(), kv)?, q)?;
        layout.back(pd.matmul(&v)?.to_dtype(q.dtype())?, q.shape())
    })?;
    // dv = pd^T g; dp = (g v^T) mask; ds = p (dp - sum(dp p)); dq = scale ds k; dk = scale ds^T q.
    let backward = move |inputs: &[Tensor],
                         _: &Tensor,
                         g: &Tensor,
                         _want: &[bool]|
          -> Result<Vec<Option<Tensor>>> {
        // The output's gradient lies as q.
        let kv = layout.kv_heads(inputs[1].shape())?;
        let rows = |x: &Tensor| layout.rows(x, kv);
        let (q, k) = operands(&rows(&inputs[0])?, &rows(&inputs[1])?)?;
        let (v, g) = (widened(&rows(&inputs[2])?)?, widened(&rows(g)?)?);
        // Each (B, heads, T, T) temporary goes once used: at most three are alive at once.
        let (p, mask) =
            probabilities(&q, &k, Attending { padding: padding.as_ref(), ..plain }, period)?;
        let dv = match &mask {
            Some(m) => (&p * m)?.t()?.matmul(&g)?,
            None => p.t()?.matmul(&g)?,
        };
        let mut dp = g.matmul(&v.t()?)?;
        if let Some(m) = mask {
            dp = (dp * m)?;
        }
        let row = (&dp * &p)?.sum_keepdim(candle_core::D::Minus1)?;
        let centred = dp.broadcast_sub(&row)?;
        drop(dp);
        let ds = (p * centred)?;
        let dq = (ds.matmul(&k)? * scale)?;
        let dk = (ds.t()?.matmul(&q)? * scale)?;
        let (dq, dk) = match &back_turns {
            Some(turns) => turns.tensors(&dq, &dk, Turn::Back)?,
            None => (dq, dk),
        };
        let back = |t: Tensor, like: &Tensor| layout.back(t.to_dtype(like.dtype())?, like.shape());
        Ok(vec![
            Some(back(dq, &inputs[0])?),
            Some(back(dk, &inputs[1])?),
            Some(back(dv, &inputs[2])?),
        ])
    };
    q.contiguous()?.apply_op3(
        &k.contiguous()?,
        &v.contiguous()?,
        GenericOp::new("generic-attention", y, Box::new(backward)),
    )
}

struct AttentionOp {
    scale: f64,
    mask: Mask,
    /// The rows of each causal block: q's rows repeat their positions every `period` rows.
    period: usize,
    /// Which keys each batch element may attend to, and the rows per batch element.
    padding: Option<(Arc<Vec<bool>>, usize)>,
    dropout: Option<(RngKey, f32)>,
    /// The rotary embedding's turn of q and k, where it applies.
    turns: Option<Turns>,
    /// How q, k, v and the output lie.
    layout: Layout,
}

impl AttentionOp {
    fn softmax(&self) -> SoftmaxOp {
        SoftmaxOp {
            scale: self.scale,
            mask: self.mask,
            rows_per_block: self.period,
            padding: self.padding.clone(),
        }
    }

    /// The probabilities (B, heads, T, T), flat, of detached q and k.
    fn probabilities<T: Elem>(&self, q: &Tensor, k: &Tensor) -> Result<Vec<T>> {
        let scores = q.matmul(&k.t()?)?.flatten_all()?.to_vec1::<T>()?;
        Ok(self.softmax().forward(&scores, k.dim(2)?))
    }

    fn drop_out<T: Elem>(&self, p: &mut [T]) {
        if let Some((key, rate)) = self.dropout {
            DropoutOp { key, p: rate }.mask_in_place(p);
        }
    }

    /// A flat (B, heads, T, S) map as a tensor, without copying it.
    fn map<T: Elem>(m: Vec<T>, q: &Tensor, k: &Tensor) -> Result<Tensor> {
        Tensor::from_vec(m, (q.dim(0)?, q.dim(1)?, q.dim(2)?, k.dim(2)?), q.device())
    }

    fn forward<T: Elem>(&self, q: Tensor, k: Tensor, v: Tensor) -> Result<Tensor> {
        let mut p = self.probabilities::<T>(&q, &k)?;
        self.drop_out(&mut p);
        Self::map(p, &q, &k)?.matmul(&v)
    }

    /// With P the probabilities and P' = dropout(P): dV = P'^T g; dP = dropout(g V^T) (the same
    /// mask); dS = softmax backward of dP (scale included); dQ = dS K; dK = dS^T Q. At most three
    /// maps of (B, heads, T, T) are alive at once.
    fn backward<T: Elem>(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let p = self.probabilities::<T>(q, k)?;
        let mut dropped = p.clone();
        self.drop_out(&mut dropped);
        let dv = Self::map(dropped, q, k)?.t()?.matmul(g)?;
        let mut dp = g.matmul(&v.t()?)?.flatten_all()?.to_vec1::<T>()?;
        self.drop_out(&mut dp);
        let ds = self.softmax().backward(&p, &dp, k.dim(2)?);
        drop((p, dp));
        let ds = Self::map(ds, q, k)?;
        Ok((ds.matmul(k)?, ds.t()?.matmul(q)?, dv))
    }
}

impl FusedOp for AttentionOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        fn run<T: Elem>(op: &AttentionOp, s: [Operand; 3]) -> Result<Vec<T>> {
            let t = |(st, l): Operand| {
                Tensor::from_slice(&slice::<T>(st, l)?, l.dims(), &candle_core::Device::Cpu)
            };
            let given = s[0].1.shape();
            let kv = op.layout.kv_heads(s[1].1.shape())?;
            let rows = |x: Operand| op.layout.rows(&t(x)?, kv);
            let (q, k) = (rows(s[0])?, rows(s[1])?);
            let (q, k) = match &op.turns {
                Some(turns) => turns.kernel::<T>(&q, &k, Turn::Forward)?,
                None => (q, k),
            };
            op.layout
                .back(op.forward::<T>(q, k, rows(s[2])?)?, given)?
                .flatten_all()?
                .to_vec1::<T>()
        }
        let args = exactly(inputs)?;
        let [(q, ql), _, (_, vl)] = args;
        let y = per_float!(q, "attention", run(self, args)?);
        let mut dims = ql.dims().to_vec();
        *dims.last_mut().expect("rank 4") = *vl.dims().last().expect("rank 4");
        Ok((y, Shape::from(dims)))
    }

    fn bwd(&self, inputs: &[&Tensor], _y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let [q, k, v] = exactly(inputs)?;
        // Half precision runs in f32 (candle's CPU matrix product has no bf16).
        let dtype = q.dtype();
        let wide = |t: &Tensor| {
            if is_half(dtype) {
                t.detach().to_dtype(DType::F32)
            } else {
                Ok(t.detach())
            }
        };
        let kv = self.layout.kv_heads(k.shape())?;
        let rows = |t: &Tensor| self.layout.rows(&wide(t)?, kv);
        let (q, k, v, g) = (rows(q)?, rows(k)?, rows(v)?, rows(g)?.contiguous()?);
        let (dq, dk, dv) = per_dtype!(q.dtype(), T => match &self.turns {
            // The gradients of the turned q and k, turned back.
            Some(turns) => {
                let (q, k) = turns.kernel::<T>(&q, &k, Turn::Forward)?;
                let (dq, dk, dv) = self.backward::<T>(&q, &k, &v, &g)?;
                let (dq, dk) = turns.kernel::<T>(&dq.contiguous()?, &dk.contiguous()?, Turn::Back)?;
                (dq, dk, dv)
            }
            None => self.backward::<T>(&q, &k, &v, &g)?,
        });
        let back = |d: Tensor, like: &Tensor| self.layout.back(d.to_dtype(dtype)?, like.shape());
        Ok(vec![Some(back(dq, inputs[0])?), Some(back(dk, inputs[1])?), Some(back(dv, inputs[2])?)])
    }
}

custom_op!(AttentionOp: 3 "fused-attention");
custom_op!(Replay<AttentionOp>: 3 "replayed-attention");
