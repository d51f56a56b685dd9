//! Scaled dot-product attention with causal mask, key padding, dropout and rotary position
//! embeddings: keeps only q, k, v (scores, probabilities and rotated q and k are rebuilt in
//! backward).

use crate::fused::dropout::DropoutOp;
use crate::fused::dtype::{widened, widened_as};
use crate::fused::elem::Elem;
use crate::fused::generic::GenericOp;
use crate::fused::matmul::{mat, matmul, Dest, Mat};
use crate::fused::op::{exactly, FusedOp, Operand};
use crate::fused::replay::{apply3, kept_or, Replay};
use crate::fused::rotary::{Rotary, Table, Turn};
use crate::fused::route::{generic, lean};
use crate::fused::softmax::{detached, softmax_last_dim, Mask, SoftmaxOp};
use crate::fused::storage::{shaped, slice, with_slice};
use crate::fused::uninit::uninit;
use candle_core::{CpuStorage, DType, Result, Shape, Tensor};
use rayon::prelude::*;
use remat::keep::OpKind;
use remat::rng::RngKey;
use std::borrow::Cow;
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
    /// q, k, v or the output's gradient as the generic route takes them: (B, kv_heads, rows, d),
    /// the query heads that share a key/value head as rows of one map (`kv_heads`: k's heads).
    /// The CPU kernel reads the same layout from the elements ([`Layout::rows_of`]).
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

    /// q and k, in the kernels' layout (rows at positions repeating every `q_period` and
    /// `k_period`), turned by the kernel.
    fn kernel<T: Elem>(&self, q: &[T], k: &[T], turn: Turn) -> Result<(Vec<T>, Vec<T>)> {
        Ok((self.table.rotate(q, self.q_period, turn)?, self.table.rotate(k, self.k_period, turn)?))
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

/// The shapes of one attention in the kernels' layout: `maps` (B x kv_heads) maps of `rows`
/// queries (the query heads that share a key/value head, one after another) by `keys` keys, one
/// map after another in memory; q's and k's heads of `d` features, v's of `dv`.
#[derive(Clone, Copy)]
struct Maps {
    maps: usize,
    rows: usize,
    keys: usize,
    d: usize,
    dv: usize,
}

impl Layout {
    /// The maps of q, k and v of these shapes, as [`Layout::rows`] lays them out.
    fn maps(self, q: &[usize], k: &[usize], v: &[usize]) -> Maps {
        let (d, dv) = (q[3], v[3]);
        match self {
            Layout::HeadsFirst => Maps { maps: q[0] * q[1], rows: q[2], keys: k[2], d, dv },
            Layout::TokensFirst => {
                Maps { maps: q[0] * k[2], rows: q[2] / k[2] * q[1], keys: k[1], d, dv }
            }
        }
    }

    /// The elements of an operand of shape `dims` in the kernels' layout (B, kv_heads, rows, d):
    /// as they are, or moved from token by token (B, T, heads, d) to heads first (a copy).
    fn rows_of<'a, T: Elem>(self, x: &'a [T], dims: &[usize]) -> Cow<'a, [T]> {
        match self {
            Layout::HeadsFirst => Cow::Borrowed(x),
            Layout::TokensFirst => Cow::Owned(swap_middle(x, [dims[0], dims[1], dims[2], dims[3]])),
        }
    }

    /// A result in the kernels' layout laid out as an operand of shape `dims`.
    fn back_to<T: Elem>(self, y: Vec<T>, dims: &[usize]) -> Vec<T> {
        match self {
            Layout::HeadsFirst => y,
            Layout::TokensFirst => swap_middle(&y, [dims[0], dims[2], dims[1], dims[3]]),
        }
    }
}

/// `x` (a, b, c, d) as (a, c, b, d), in parallel over its rows of d.
fn swap_middle<T: Elem>(x: &[T], [a, b, c, d]: [usize; 4]) -> Vec<T> {
    debug_assert_eq!(x.len(), a * b * c * d);
    // SAFETY: each (a, c) block below is written whole, row by row.
    let mut y = unsafe { uninit::<T>(x.len()) };
    y.par_chunks_mut(b * d).enumerate().for_each(|(ac, y)| {
        let (ai, ci) = (ac / c, ac % c);
        for (bi, row) in y.chunks_exact_mut(d).enumerate() {
            let at = ((ai * b + bi) * c + ci) * d;
            row.copy_from_slice(&x[at..at + d]);
        }
    });
    y
}

/// `a[i] @ b[i]` (m, k) x (k, n) for each of `maps` pairs of matrices stored one after another,
/// each operand read transposed where its flag says (stored (k, m) or (n, k)): the products of
/// the maps, one after another, each split over the threads.
fn per_map<T: Elem>(
    maps: usize,
    (a, a_t): (&[T], bool),
    (b, b_t): (&[T], bool),
    (m, k, n): (usize, usize, usize),
) -> Vec<T> {
    fn operand<T>(x: &[T], i: usize, len: usize, t: bool) -> Mat<'_, T> {
        let x = mat(&x[i * len..(i + 1) * len]);
        if t {
            x.transposed()
        } else {
            x
        }
    }
    // SAFETY: each map's product overwrites its block whole.
    let mut dst = unsafe { uninit::<T>(maps * m * n) };
    for (i, dst) in dst.chunks_exact_mut(m * n).enumerate() {
        let (a, b) = (operand(a, i, m * k, a_t), operand(b, i, k * n, b_t));
        matmul(dst, a, b, (m, k, n), Dest::Overwrite);
    }
    dst
}

/// q and k in the kernels' layout, borrowed or made.
type QK<'a, T> = (Cow<'a, [T]>, Cow<'a, [T]>);

impl AttentionOp {
    fn softmax(&self) -> SoftmaxOp {
        SoftmaxOp {
            scale: self.scale,
            mask: self.mask,
            rows_per_block: self.period,
            padding: self.padding.clone(),
        }
    }

    /// The probabilities, map after map, of (turned) q and k in the kernels' layout.
    fn probabilities<T: Elem>(&self, q: &[T], k: &[T], s: Maps) -> Vec<T> {
        let scores = per_map(s.maps, (q, false), (k, true), (s.rows, s.d, s.keys));
        self.softmax().forward(&scores, s.keys)
    }

    fn drop_out<T: Elem>(&self, p: &mut [T]) {
        if let Some((key, rate)) = self.dropout {
            DropoutOp { key, p: rate }.mask_in_place(p);
        }
    }

    fn forward<T: Elem>(&self, q: &[T], k: &[T], v: &[T], s: Maps) -> Vec<T> {
        let mut p = self.probabilities(q, k, s);
        self.drop_out(&mut p);
        per_map(s.maps, (&p, false), (v, false), (s.rows, s.keys, s.dv))
    }

    /// With P the probabilities and P' = dropout(P): dV = P'^T g; dP = dropout(g V^T) (the same
    /// mask); dS = softmax backward of dP (scale included); dQ = dS K; dK = dS^T Q. At most three
    /// maps of (B, heads, T, T) are alive at once (two without dropout).
    fn backward<T: Elem>(
        &self,
        (q, k, v): (&[T], &[T], &[T]),
        g: &[T],
        s: Maps,
    ) -> (Vec<T>, Vec<T>, Vec<T>) {
        let p = self.probabilities(q, k, s);
        let dv_of = |p: &[T]| per_map(s.maps, (p, true), (g, false), (s.keys, s.rows, s.dv));
        let dv = match self.dropout {
            Some(_) => {
                let mut dropped = p.clone();
                self.drop_out(&mut dropped);
                dv_of(&dropped)
            }
            None => dv_of(&p),
        };
        let mut dp = per_map(s.maps, (g, false), (v, true), (s.rows, s.dv, s.keys));
        self.drop_out(&mut dp);
        let ds = self.softmax().backward(&p, &dp, s.keys);
        drop((p, dp));
        let dq = per_map(s.maps, (&ds, false), (k, false), (s.rows, s.keys, s.d));
        let dk = per_map(s.maps, (&ds, true), (q, false), (s.keys, s.rows, s.d));
        (dq, dk, dv)
    }

    /// q and k turned by the rotary embedding, where there is one.
    fn turned<'a, T: Elem>(
        &self,
        q: Cow<'a, [T]>,
        k: Cow<'a, [T]>,
        turn: Turn,
    ) -> Result<QK<'a, T>> {
        Ok(match &self.turns {
            Some(turns) => {
                let (q, k) = turns.kernel(&q, &k, turn)?;
                (Cow::Owned(q), Cow::Owned(k))
            }
            None => (q, k),
        })
    }
}

impl FusedOp for AttentionOp {
    fn cpu_fwd(&self, inputs: &[Operand]) -> Result<(CpuStorage, Shape)> {
        fn run<T: Elem>(op: &AttentionOp, [q, k, v]: [Operand; 3]) -> Result<Vec<T>> {
            let (qd, kd, vd) = (q.1.dims(), k.1.dims(), v.1.dims());
            let (qs, ks, vs) =
                (slice::<T>(q.0, q.1)?, slice::<T>(k.0, k.1)?, slice::<T>(v.0, v.1)?);
            let s = op.layout.maps(qd, kd, vd);
            let (q, k) = (op.layout.rows_of(&qs, qd), op.layout.rows_of(&ks, kd));
            let (q, k) = op.turned(q, k, Turn::Forward)?;
            let y = op.forward(&q, &k, &op.layout.rows_of(&vs, vd), s);
            let mut out = qd.to_vec();
            out[3] = s.dv;
            Ok(op.layout.back_to(y, &out))
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
        let g = g.contiguous()?;
        let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
        let s = self.layout.maps(qd, kd, vd);
        // Half precision is read widened to f32 (`with_slice`), and the gradients made in f32.
        per_dtype!(q.dtype(), T => {
            let (dq, dk, dv) = with_slice::<T, _>(q, |qs| with_slice(k, |ks| with_slice(v, |vs| {
                with_slice(&g, |gs| {
                    let l = self.layout;
                    let (q, k) = self.turned(l.rows_of(qs, qd), l.rows_of(ks, kd), Turn::Forward)?;
                    let (v, g) = (l.rows_of(vs, vd), l.rows_of(gs, g.dims()));
                    let (dq, dk, dv) = self.backward((&q, &k, &v), &g, s);
                    // The gradients of the turned q and k, turned back.
                    let (dq, dk) = self.turned(Cow::Owned(dq), Cow::Owned(dk), Turn::Back)?;
                    Ok((l.back_to(dq.into_owned(), qd), l.back_to(dk.into_owned(), kd), l.back_to(dv, vd)))
                })
            })))?;
            Ok(vec![Some(shaped(dq, q)?), Some(shaped(dk, k)?), Some(shaped(dv, v)?)])
        })
    }
}

custom_op!(AttentionOp: 3 "fused-attention");
custom_op!(Replay<AttentionOp>: 3 "replayed-attention");
