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
/// needs none). The op keeps q and k as given: it turns them again in backward, and turns their
/// gradients back, where rotating them beforehand would keep a rotated copy of each beside the
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
    attend(q, k, v, Attending { scale, mask, padding: None, dropout, rotary: Some(rotary) })
}

/// [`attention`] or [`rotary_attention`], as `how` says.
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, how: Attending) -> Result<Tensor> {
    let (b, heads, t, d) = q.dims4()?;
    let kv_heads = k.dim(1)?;
    if kv_heads == heads {
        return attention_rows(q, k, v, how, t);
    }
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) || v.dim(1)? != kv_heads {
        candle_core::bail!(
            "attention: {heads} query heads cannot share {kv_heads} key and {} value heads",
            v.dim(1)?
        )
    }
    // (B, heads, T, d) is (B, kv_heads, heads/kv_heads x T, d) as it lies in memory.
    let grouped = q.contiguous()?.reshape((b, kv_heads, heads / kv_heads * t, d))?;
    let y = attention_rows(&grouped, k, v, how, t)?;
    y.reshape((b, heads, t, ()))
}

/// [`attention`] of q (B, h, R, d) whose rows are queries at positions 0..`period`, repeated
/// every `period` rows (R = period unless grouped-query attention folded heads into the rows).
fn attention_rows(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    how: Attending,
    period: usize,
) -> Result<Tensor> {
    let (b, heads, t, _) = q.dims4()?;
    let s = k.dim(2)?;
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
            return attention_generic(q, k, v, how, period, turns, kept);
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
                heads * t,
            )),
            None => None,
        };
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.to_dtype(q.dtype())?.contiguous()?);
        let Attending { scale, mask, dropout, .. } = how;
        apply3(&q, &k, &v, AttentionOp { scale, mask, period, padding, dropout, turns }, kept)
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
/// mask, so the op keeps only q, k and v. `kept`: its output, kept from the forward
/// (`remat::keep`).
fn attention_generic(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    how: Attending,
    period: usize,
    turns: Option<Turns>,
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
        let (qt, kt) = operands(&q.detach(), &k.detach())?;
        let (p, mask) =
            probabilities(&qt, &kt, Attending { padding: padding.as_ref(), ..plain }, period)?;
        let pd = match &mask {
            Some(m) => (p * m)?,
            None => p,
        };
        pd.matmul(&widened_as(&v.detach(), q)?)?.to_dtype(q.dtype())
    })?;
    // dv = pd^T g; dp = (g v^T) mask; ds = p (dp - sum(dp p)); dq = scale ds k; dk = scale ds^T q.
    let backward = move |inputs: &[Tensor],
                         _: &Tensor,
                         g: &Tensor,
                         _want: &[bool]|
          -> Result<Vec<Option<Tensor>>> {
        let (q, k) = operands(&inputs[0], &inputs[1])?;
        let (v, g) = (widened(&inputs[2])?, widened(g)?);
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
        let back = |t: Tensor, like: &Tensor| t.to_dtype(like.dtype());
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

    fn forward<T: Elem>(&self, q: Tensor, k: Tensor, v: Tensor) -> Result<Vec<T>> {
        let mut p = self.probabilities::<T>(&q, &k)?;
        self.drop_out(&mut p);
        Self::map(p, &q, &k)?.matmul(&v)?.flatten_all()?.to_vec1::<T>()
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
            let (q, k) = (t(s[0])?, t(s[1])?);
            let (q, k) = match &op.turns {
                Some(turns) => turns.kernel::<T>(&q, &k, Turn::Forward)?,
                None => (q, k),
            };
            op.forward::<T>(q, k, t(s[2])?)
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
        let (q, k, v, g) = (wide(q)?, wide(k)?, wide(v)?, wide(g)?.contiguous()?);
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
        Ok(vec![Some(dq.to_dtype(dtype)?), Some(dk.to_dtype(dtype)?), Some(dv.to_dtype(dtype)?)])
    }
}

custom_op!(AttentionOp: 3 "fused-attention");
custom_op!(Replay<AttentionOp>: 3 "replayed-attention");
