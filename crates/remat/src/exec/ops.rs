//! The candle ops the executor adds: gradient sums in place, the seed that starts a stage's
//! backward from a given gradient, and the variables a stage graph reads its inputs through.

use crate::Result;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, DType, InplaceOp2, Layout, Shape, Tensor, Var};

/// A variable over `t`'s value for a stage graph to read it through (Rule 4). With
/// `patched-candle`, over its memory (`Var::sharing`): it costs no bytes. On candle as published,
/// `Var::from_tensor`: `t` itself where it is a variable already (a value stored at a cut, see
/// [`stored_value`]), else a copy of it, held while the value is (the price of stock candle: a
/// value read in the segment that produced it is held twice).
pub(crate) fn var_over(t: &Tensor) -> Result<Var> {
    #[cfg(feature = "patched-candle")]
    return Ok(Var::sharing(t));
    #[cfg(not(feature = "patched-candle"))]
    return Ok(Var::from_tensor(t)?);
}

/// A value stored at a cut (Rule 1), detached from its producer's graph. On candle as published
/// it is made a variable here, once (a copy, while its segment's run still holds the original;
/// dropped with it), so that every segment that reads it reads it through that variable
/// ([`var_over`]) instead of copying it again: a stage boundary is not held twice.
pub(super) fn stored_value(t: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "patched-candle")]
    return Ok(t.detach());
    #[cfg(not(feature = "patched-candle"))]
    return Ok(Var::from_tensor(&t.detach())?.into_inner());
}

/// Elements of an output that [`digest`] reads at most.
const DIGEST_SAMPLES: usize = 1024;

/// A digest of `t` for the recompute check: its shape, dtype and the bits of up to
/// [`DIGEST_SAMPLES`] of its elements, evenly spread (a dropout mask drawn anew changes about
/// p of them). Reads a few KiB whatever the tensor's size (gathered on its device, then copied).
/// `None` for a tensor that is not contiguous (sampling it would copy it whole).
pub(super) fn digest(t: &Tensor) -> Result<Option<u64>> {
    use std::hash::{Hash, Hasher};
    if !t.is_contiguous() {
        return Ok(None);
    }
    let n = t.elem_count();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (t.dims(), t.dtype().as_str()).hash(&mut h);
    if n > 0 {
        let picks = n.min(DIGEST_SAMPLES);
        let at: Vec<u32> = (0..picks).map(|k| (k * n / picks) as u32).collect();
        let at = Tensor::from_vec(at, picks, t.device())?;
        // f64 holds every float and small integer dtype's values exactly: equal bits, equal values.
        let values =
            t.flatten_all()?.index_select(&at, 0)?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        values.iter().for_each(|v| v.to_bits().hash(&mut h));
    }
    Ok(Some(h.finish()))
}

/// `store[p] += g`: in place where it can be (the same bits as candle's `acc + g`).
pub(super) fn add_into(store: &mut GradStore, p: &Var, g: Tensor) -> Result<()> {
    let sum = match store.get(p.as_tensor()) {
        Some(acc) if adds_in_place(acc, &g) => {
            acc.inplace_op2(&g.contiguous()?, &AddAssign)?;
            return Ok(());
        }
        Some(acc) => (acc + g)?,
        None => g,
    };
    store.insert(p.as_tensor(), sum);
    Ok(())
}

/// Whether `acc += g` can run in place ([`AddAssign`], CPU); elsewhere the sum is a new tensor.
/// The same bits as candle's `acc + g` either way.
fn adds_in_place(acc: &Tensor, g: &Tensor) -> bool {
    acc.device().is_cpu()
        && acc.is_contiguous()
        && g.dtype() == acc.dtype()
        && g.shape() == acc.shape()
}

struct AddAssign;

impl InplaceOp2 for AddAssign {
    fn name(&self) -> &'static str {
        "remat-add-assign"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        fn add<T: Copy + std::ops::Add<Output = T>>(a: &mut [T], b: &[T]) {
            a.iter_mut().zip(b).for_each(|(a, &b)| *a = *a + b);
        }
        let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle_core::bail!("remat-add-assign: operands must be contiguous")
        };
        match (s1, s2) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => add(&mut a[a0..a1], &b[b0..b1]),
            (CpuStorage::F64(a), CpuStorage::F64(b)) => add(&mut a[a0..a1], &b[b0..b1]),
            (CpuStorage::F16(a), CpuStorage::F16(b)) => add(&mut a[a0..a1], &b[b0..b1]),
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => add(&mut a[a0..a1], &b[b0..b1]),
            _ => candle_core::bail!("remat-add-assign: float operands of one dtype only"),
        }
        Ok(())
    }
}

/// A zero scalar whose backward hands `grad` to `t` unchanged: `t`'s gradient becomes `0 + grad`,
/// as in a plain backward. Handed over, not shared: the seed gives the gradient up in its backward
/// (a stage's root runs one backward), so candle stores it as its only holder, without a copy, and
/// it is freed as soon as the stage's ops have read it rather than when the stage's backward
/// returns (16 MiB less in flight for a U-Net decoder level at 32^3). `seed(t, g)?.backward()` is
/// the backward of whatever made `t` from the gradient `g`, as a stage's backward runs it (the
/// kernel bench times an op's backward this way).
pub fn seed(t: &Tensor, grad: Tensor) -> Result<Tensor> {
    if t.device().is_cpu() {
        Ok(t.apply_op1(GradSeed(std::sync::Mutex::new(Some(grad))))?)
    } else {
        // No device kernel for the custom op yet: sum(t * g) has the same gradient, 1 * g = g.
        Ok((t * grad)?.sum_all()?.to_dtype(DType::F32)?)
    }
}

struct GradSeed(std::sync::Mutex<Option<Tensor>>);

impl CustomOp1 for GradSeed {
    fn name(&self) -> &'static str {
        "remat-grad-seed"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![0.0]), Shape::from(())))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        _grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let grad = self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        match grad {
            Some(grad) => Ok(Some(grad)),
            None => candle_core::bail!(
                "remat-grad-seed: a second backward through one seed (its gradient was handed over \
                 in the first)"
            ),
        }
    }
}
