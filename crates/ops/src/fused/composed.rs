//! The convolutions composed from candle ops that all have a backward, so they run on any
//! device: the fallback where no fused route applies, and the backward of the generic route. Not
//! here: the CPU kernels (`conv3d`, `conv_transpose3d`), the geometry they share
//! ([`Conv3dGeometry`], beside the kernels' own shapes).

use crate::fused::conv3d::Conv3dGeometry;
use crate::fused::op::Want;
use candle_core::{Result, Tensor};

/// The composed 3D convolution: every op has a candle backward, so it runs on any device.
pub(crate) fn conv3d_composed(x: &Tensor, w: &Tensor, g: Conv3dGeometry) -> Result<Tensor> {
    let (n, c, d, h, wd) = x.dims5()?;
    let (o, c_w, kd, _, _) = w.dims5()?;
    if c != c_w {
        candle_core::bail!("conv3d: input has {c} channels, the kernel expects {c_w}")
    }
    if g.stride_hw > 1 && h % 2 != wd % 2 {
        // candle 0.11's conv2d backward mis-shapes such inputs.
        candle_core::bail!(
            "conv3d: strided in-plane convolution needs height and width of equal parity, got \
             {h}x{wd}"
        )
    }
    let x = x.pad_with_zeros(2, g.pad_d, g.pad_d)?;
    let dp = d + 2 * g.pad_d;
    if dp < kd {
        candle_core::bail!("conv3d: depth {d} (padded {dp}) is smaller than the kernel depth {kd}")
    }
    let d_out = (dp - kd) / g.stride_d + 1;
    let (kh, kw) = (w.dim(3)?, w.dim(4)?);
    let (ho, wo) =
        ((h + 2 * g.pad_hw - kh) / g.stride_hw + 1, (wd + 2 * g.pad_hw - kw) / g.stride_hw + 1);
    let mut rows = Vec::new();
    let entries = column_entries(x.elem_count().max(w.elem_count()).max(n * o * d_out * ho * wo));
    for chunk in chunks(n, d_out, dp, c * kh * kw * ho * wo, entries) {
        let mut sum: Option<Tensor> = None;
        for a in 0..kd {
            let y = chunk.slices(&x, a, g.stride_d)?.conv2d(
                &w.narrow(2, a, 1)?.squeeze(2)?,
                g.pad_hw,
                g.stride_hw,
                1,
                1,
            )?; // (rows, O, H', W')
            sum = Some(match sum {
                Some(s) => (s + y)?,
                None => y,
            });
        }
        rows.push(sum.expect("kd >= 1"));
    }
    let y = Tensor::cat(&rows, 0)?; // (N * D_out, O, H', W')
    drop(rows);
    // (N, O, D_out, H', W')
    y.reshape((n, d_out, o, ho, wo))?.permute((0, 2, 1, 3, 4))?.contiguous()
}

/// Entries of the column matrix candle's `conv2d` builds for one chunk of input slices, at most:
/// the composed convolution runs in chunks of slices, so that matrix stays bounded instead of
/// growing with batch and depth (9x the input for 3x3 kernels).
const COLUMN_ENTRIES: usize = 1 << 21;

/// The column entries of a chunk for a convolution whose largest tensor (input, output, kernel)
/// has `largest` entries: [`COLUMN_ENTRIES`], or fewer for a small problem, whose columns are then
/// of the order of its own tensors (as the fused kernel's workspaces are).
fn column_entries(largest: usize) -> usize {
    COLUMN_ENTRIES.min(largest)
}

/// The input slices one `conv2d` call takes: output depths `start..start + rows` of batch
/// elements `b..b + batches` (several elements only for a 2D convolution, one depth each).
#[derive(Clone, Copy)]
struct Chunk {
    b: usize,
    batches: usize,
    start: usize,
    rows: usize,
}

/// Chunks that cover every batch element's `d_out` output depths of x padded to depth `dp`, each
/// with at most `entries` column entries ([`column_entries`]) at `per_slice` entries per slice (at
/// least one slice): consecutive samples for a 2D convolution, consecutive depths of one sample
/// for 3D.
fn chunks(n: usize, d_out: usize, dp: usize, per_slice: usize, entries: usize) -> Vec<Chunk> {
    let fit = (entries / per_slice.max(1)).max(1);
    if dp == 1 {
        return (0..n)
            .step_by(fit)
            .map(|b| Chunk { b, batches: fit.min(n - b), start: 0, rows: 1 })
            .collect();
    }
    let rows = fit.min(d_out);
    (0..n)
        .flat_map(|b| {
            (0..d_out).step_by(rows).map(move |start| Chunk {
                b,
                batches: 1,
                start,
                rows: rows.min(d_out - start),
            })
        })
        .collect()
}

impl Chunk {
    /// The padded depths kernel depth `a` reads for this chunk's output depths.
    fn depths(&self, a: usize, stride_d: usize, device: &candle_core::Device) -> Result<Tensor> {
        Tensor::from_vec(
            (self.start..self.start + self.rows)
                .map(|i| (a + i * stride_d) as u32)
                .collect::<Vec<_>>(),
            self.rows,
            device,
        )
    }

    /// The input slices kernel depth `a` sees, of x (N, C, D, H, W) padded in depth:
    /// (batches rows, C, H, W); a view where x has one depth (a 2D convolution), else a copy.
    fn slices(&self, x: &Tensor, a: usize, stride_d: usize) -> Result<Tensor> {
        let (_, c, d, h, wd) = x.dims5()?;
        let x = x.narrow(0, self.b, self.batches)?;
        if d == 1 {
            return x.reshape((self.batches, c, h, wd));
        }
        x.index_select(&self.depths(a, stride_d, x.device())?, 2)?
            .permute((0, 2, 1, 3, 4))?
            .reshape((self.batches * self.rows, c, h, wd))
    }
}

/// The gradients of [`conv3d_composed`]'s input and weight from its output gradient `grad`
/// (N, O, D_out, H', W'), composed the same way, chunk by chunk: per kernel depth, candle's own
/// conv2d backward (a transposed convolution gives the input slices' gradient, a convolution of the
/// slices with the output gradient the weight's), the slices' gradients added back at the depths
/// they came from. `want`: whether the input's and the weight's gradients are wanted; one not
/// wanted (an image, a frozen weight) is not computed, and comes back `None`.
pub(crate) fn conv3d_composed_backward(
    x: &Tensor,
    w: &Tensor,
    grad: &Tensor,
    g: Conv3dGeometry,
    want: Want,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let Want { dx: want_dx, dw: want_dw } = want;
    let (n, c, d, h, wd) = x.dims5()?;
    let (o, _, kd, kh, kw) = w.dims5()?;
    let (_, _, d_out, ho, wo) = grad.dims5()?;
    let xp = x.pad_with_zeros(2, g.pad_d, g.pad_d)?;
    let dp = d + 2 * g.pad_d;
    // conv_transpose2d's output falls short of the input by the rows a strided window never
    // reached: the output padding adds them back.
    let out_padding = h + 2 * g.pad_hw - ((ho - 1) * g.stride_hw + kh);
    // Per chunk of samples, their input gradient (batches, C, D padded, H, W), in batch order.
    let mut dxs: Vec<Tensor> = Vec::new();
    let mut dws: Vec<Option<Tensor>> = vec![None; kd];
    let entries = column_entries(x.elem_count().max(w.elem_count()).max(grad.elem_count()));
    for chunk in chunks(n, d_out, dp, c * kh * kw * ho * wo, entries) {
        let slices_of = chunk.batches * chunk.rows;
        let gf = grad.narrow(0, chunk.b, chunk.batches)?.narrow(2, chunk.start, chunk.rows)?;
        // (slices, O, H', W')
        let gf = gf.permute((0, 2, 1, 3, 4))?.reshape((slices_of, o, ho, wo))?;
        let gf_t = gf.transpose(0, 1)?; // (O, slices, H', W')
        if chunk.start == 0 && dp > 1 && want_dx {
            dxs.push(Tensor::zeros((chunk.batches, c, dp, h, wd), x.dtype(), x.device())?);
        }
        for a in (0..kd).filter(|_| want_dx) {
            let wa = w.narrow(2, a, 1)?.squeeze(2)?.contiguous()?; // (O, C, kh, kw)
                                                                   // (slices, C, H, W)
            let ds = gf.conv_transpose2d(&wa, g.pad_hw, out_padding, g.stride_hw, 1)?;
            let ds = ds
                .reshape((chunk.batches, chunk.rows, c, h, wd))?
                .permute((0, 2, 1, 3, 4))?
                .contiguous()?; // (batches, C, rows, H, W)
            if dp == 1 {
                dxs.push(ds); // a 2D convolution: one kernel depth, one slice per sample
            } else {
                let dx = dxs.last_mut().expect("pushed at the sample's first chunk");
                *dx = dx.index_add(&chunk.depths(a, g.stride_d, x.device())?, &ds, 2)?;
            }
        }
        for (a, dw) in dws.iter_mut().enumerate().filter(|_| want_dw) {
            let slices = chunk.slices(&xp, a, g.stride_d)?;
            let dwa = slices
                .transpose(0, 1)?
                .conv2d(&gf_t, g.pad_hw, 1, g.stride_hw, 1)?
                .transpose(0, 1)?; // (O, C, >= kh, >= kw)
            let dwa = dwa.narrow(2, 0, kh)?.narrow(3, 0, kw)?;
            *dw = Some(match dw.take() {
                Some(sum) => (sum + dwa)?,
                None => dwa,
            });
        }
    }
    let dx = want_dx.then(|| Tensor::cat(&dxs, 0)?.narrow(2, g.pad_d, d)).transpose()?;
    let dw = want_dw
        .then(|| {
            Tensor::stack(&dws.into_iter().map(|dw| dw.expect("kd >= 1")).collect::<Vec<_>>(), 2)
        })
        .transpose()?;
    Ok((dx, dw))
}

/// The composed up-convolution: transposed 3D convolution with kernel = stride = 2 plus a bias,
/// one matrix product and a reshape (each input voxel writes its own 2x2x2 output block).
pub(crate) fn conv_transpose3d_k2s2_composed(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (n, c, d, h, wd) = x.dims5()?;
    let (c_w, o, k1, k2, k3) = w.dims5()?;
    if c != c_w || (k1, k2, k3) != (2, 2, 2) {
        candle_core::bail!(
            "conv_transpose3d_k2s2: kernel {:?} does not fit input with {c} channels",
            w.dims()
        )
    }
    let cols = x.permute((0, 2, 3, 4, 1))?.reshape((n * d * h * wd, c))?; // (N*D*H*W, C)
    let y = cols.matmul(&w.reshape((c, o * 8))?)?; // (N*D*H*W, O*8)
    y.reshape(vec![n, d, h, wd, o, 2, 2, 2])?
        .permute([0, 4, 1, 5, 2, 6, 3, 7])? // (N, O, D, 2, H, 2, W, 2)
        .reshape((n, o, 2 * d, 2 * h, 2 * wd))?
        .broadcast_add(&b.reshape((1, o, 1, 1, 1))?)
}
