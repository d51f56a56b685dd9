//! How a convolution and its weight gradient run directly on this machine: the instruction set
//! ([`Isa`], detected at run time) and the tile, sized to the vector registers ([`Plan`],
//! [`WeightPlan`]); `None` where the direct kernels do not take the convolution. Not here: the
//! kernels (`forward`, `weight_gradient`, `simd`).

use crate::fused::conv3d::shape::Conv3dShape;

/// How a convolution runs directly on this machine: the instruction set and the tile.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Plan {
    pub(super) isa: Isa,
    /// Vectors of output channels per tile: T = `vectors` x the vector's lanes.
    pub(super) vectors: usize,
    /// Output rows and columns per tile (R, Q).
    pub(super) rows: usize,
    pub(super) cols: usize,
}

/// An instruction set the direct kernels have instances for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Isa {
    Avx512,
    Avx2,
}

impl Isa {
    /// The widest this processor has, if any.
    pub(super) fn detect() -> Option<Isa> {
        Isa::available().first().copied()
    }

    /// Those this processor has, the widest first.
    pub(super) fn available() -> Vec<Isa> {
        let mut isas = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                isas.push(Isa::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                isas.push(Isa::Avx2);
            }
        }
        isas
    }

    /// f32 lanes of a vector.
    fn lanes(self) -> usize {
        match self {
            Isa::Avx512 => 16,
            Isa::Avx2 => 8,
        }
    }

    /// Accumulators a tile may hold: the registers (32 or 16) less the weights' vectors and the
    /// broadcast, with one to spare.
    fn accumulators(self, vectors: usize) -> usize {
        match self {
            Isa::Avx512 => 30 - vectors,
            Isa::Avx2 => 14 - vectors,
        }
    }
}

impl Plan {
    /// The plan for convolution `s`, where it runs directly: a kernel other than 1x1x1, a column
    /// stride of 1 or 2, on a processor with AVX2 and FMA or AVX-512. Two vectors of output
    /// channels per tile where they fill it ([`vectors`]), else one; eight columns where the
    /// output rows are made of eights, else four; as many rows as the accumulators allow, up to
    /// three.
    pub(crate) fn of(s: &Conv3dShape) -> Option<Plan> {
        Plan::for_isa(s, Isa::detect()?)
    }

    pub(super) fn for_isa(s: &Conv3dShape, isa: Isa) -> Option<Plan> {
        if s.kernel == [1; 3] || s.stride[2] > 2 {
            return None;
        }
        let vectors = vectors(s, isa);
        let ow = s.output[2];
        let budget = isa.accumulators(vectors);
        let cols = if ow.is_multiple_of(8) && 8 * vectors <= budget { 8 } else { 4 };
        let rows = (budget / (cols * vectors)).clamp(1, 3).min(s.output[1]);
        Some(Plan { isa, vectors, rows, cols })
    }

    /// Output channels per tile.
    pub(super) fn channels(&self) -> usize {
        self.vectors * self.isa.lanes()
    }
}

/// Vectors of output channels per tile: two where they fill it (halving the broadcasts per
/// multiply-add), else one.
fn vectors(s: &Conv3dShape, isa: Isa) -> usize {
    if s.o.is_multiple_of(2 * isa.lanes()) {
        2
    } else {
        1
    }
}

/// How a weight gradient runs directly on this machine: the instruction set, the vectors of
/// output channels per task, and the kernel rows (input channel, kd, kh) a task sums at once.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WeightPlan {
    pub(super) isa: Isa,
    pub(super) vectors: usize,
    pub(super) groups: usize,
}

impl WeightPlan {
    /// The plan for the weight gradient of convolution `s`, where it runs directly: a kernel
    /// other than 1x1x1 and 1, 2, 3 or 7 wide, a column stride of 1 or 2, on a processor with
    /// AVX2 and FMA or AVX-512. As many kernel rows at once as the accumulators (rows x kw x
    /// vectors) allow, up to four, or eight where they divide the rows.
    pub(crate) fn of(s: &Conv3dShape) -> Option<WeightPlan> {
        WeightPlan::for_isa(s, Isa::detect()?)
    }

    pub(super) fn for_isa(s: &Conv3dShape, isa: Isa) -> Option<WeightPlan> {
        let kw = s.kernel[2];
        if s.kernel == [1; 3] || s.stride[2] > 2 || ![1, 2, 3, 7].contains(&kw) {
            return None;
        }
        let rows = s.c * s.kernel[0] * s.kernel[1];
        let fits = |v: usize, g: usize| g * kw * v <= isa.accumulators(v);
        let vectors = [vectors(s, isa), 1].into_iter().find(|&v| fits(v, 1))?;
        let groups = [8, 4, 3, 2, 1]
            .into_iter()
            .find(|&g| fits(vectors, g) && (g < 8 || rows.is_multiple_of(8)))?;
        Some(WeightPlan { isa, vectors, groups })
    }

    /// Output channels per task.
    pub(super) fn channels(&self) -> usize {
        self.vectors * self.isa.lanes()
    }
}
