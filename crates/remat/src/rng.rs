//! Counter-based random numbers: every draw is a pure function of a key and an index.
//!
//! candle's CPU generator cannot be seeded and its draws are not reproducible, and global RNG
//! state cannot be rewound for a recompute. So every random tensor in a training step comes from
//! a [`RngKey`] built from (seed, step, stage, call site, pass): a recompute of a stage draws the
//! same key and therefore the same dropout mask, while other steps and stages draw different ones.

/// Identifies one random draw within a training run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RngKey {
    /// The run's seed.
    pub seed: u64,
    /// The training step (`u64::MAX` for a [`RngKey::named`] key).
    pub step: u64,
    /// The stage (for a named key, a hash of its name).
    pub stage: u64,
    /// The how-many-th draw within the stage's forward (dropout site).
    pub call: u64,
    /// 0 for every pass when RNG replay is on; a recompute with replay switched off uses 1.
    pub pass: u64,
}

/// 2^64 over the golden ratio: the odd constant that spreads consecutive integers (a key's parts,
/// a stream's word numbers, [`derive_seed`]'s streams) apart before [`mix`].
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The seed of stream `stream` of a run seeded `seed`: `seed` itself for stream 0, for the others
/// seeds whose keys draw other numbers (data-parallel ranks: rank 0 draws what a one-rank run
/// draws, the others their own dropout masks).
pub fn derive_seed(seed: u64, stream: u64) -> u64 {
    seed ^ stream.wrapping_mul(GOLDEN)
}

/// Inverted dropout with drop probability `p`, element by element: an element whose uniform draw
/// `u` (its index in a key's stream, [`RngKey::uniform_into`]) is below `1 - p` is kept and scaled
/// by `1 / (1 - p)`, the others are zeroed. The one rule of every dropout mask (that of
/// [`RngKey::dropout_mask`], and of a fused kernel drawing the mask in pieces): the same key and
/// `p` give the same mask.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutRule {
    keep: f32,
}

impl DropoutRule {
    /// The rule of drop probability `p` (in [0, 1): [`crate::StageCtx::dropout_key`] checks it).
    pub fn new(p: f32) -> Self {
        DropoutRule { keep: 1.0 - p }
    }

    /// `1 / (1 - p)` in f32, what a kept element is multiplied by: a kernel of another element
    /// type converts it once.
    pub fn scale(self) -> f32 {
        1.0 / self.keep
    }

    /// The mask at the draw `u`: `scale` (the caller's [`DropoutRule::scale`], in its element
    /// type) where the element is kept, `zero` where it is dropped.
    #[inline]
    pub fn mask<T>(self, u: f32, scale: T, zero: T) -> T {
        if u < self.keep {
            scale
        } else {
            zero
        }
    }
}

/// The SplitMix64 finaliser: a bijective 64-bit mix with good avalanche.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl RngKey {
    /// A key for something that is not part of a step (e.g. weight initialisation).
    pub fn named(seed: u64, name: &str) -> Self {
        // FNV-1a: stable across platforms and Rust versions, unlike `DefaultHasher`.
        let h = name
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        RngKey { seed, step: u64::MAX, stage: h, call: 0, pass: 0 }
    }

    fn word(&self) -> u64 {
        [self.seed, self.step, self.stage, self.call, self.pass]
            .iter()
            .fold(0u64, |acc, &part| mix(acc.wrapping_add(GOLDEN) ^ part))
    }

    /// `n` draws uniform in [0, 1) with 24 bits of resolution (exact in f32).
    pub fn uniform(&self, n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n];
        self.uniform_into(0, &mut out);
        out
    }

    /// Draws `start..start + out.len()` of this key's uniform stream: the values `uniform` gives at
    /// those indices, so a long stream can be drawn in pieces, in parallel, or again in backward.
    /// Word k of the stream gives draws 2k (its high 24 bits) and 2k + 1 (bits 8-31).
    pub fn uniform_into(&self, start: usize, out: &mut [f32]) {
        let (base, scale) = (self.word(), 1.0 / (1u32 << 24) as f32);
        let word =
            |k: usize| mix(base.wrapping_add((k as u64).wrapping_add(1).wrapping_mul(GOLDEN)));
        let mut current = (start / 2, word(start / 2));
        for (i, o) in (start..).zip(out.iter_mut()) {
            if current.0 != i / 2 {
                current = (i / 2, word(i / 2));
            }
            let w = current.1;
            let u = if i % 2 == 0 { (w >> 40) as u32 } else { ((w >> 8) & 0xFF_FFFF) as u32 };
            *o = u as f32 * scale;
        }
    }

    /// `n` draws from N(mean, std^2) (Box-Muller on pairs of uniforms).
    pub fn normal(&self, n: usize, mean: f32, std: f32) -> Vec<f32> {
        let u = self.uniform(n + n % 2);
        u.chunks_exact(2)
            .flat_map(|p| {
                let r = (-2.0 * (1.0 - p[0]).ln()).sqrt();
                let t = std::f32::consts::TAU * p[1];
                [mean + std * r * t.cos(), mean + std * r * t.sin()]
            })
            .take(n)
            .collect()
    }

    /// An inverted-dropout mask of `n` elements: `1 / (1 - p)` where kept, `0` where dropped
    /// ([`DropoutRule`]).
    pub fn dropout_mask(&self, n: usize, p: f32) -> Vec<f32> {
        let rule = DropoutRule::new(p);
        let scale = rule.scale();
        self.uniform(n).into_iter().map(|u| rule.mask(u, scale, 0.0)).collect()
    }

    /// [`RngKey::dropout_mask`] as a tensor of `like`'s shape, dtype and device.
    pub fn dropout_mask_like(
        &self,
        like: &candle_core::Tensor,
        p: f32,
    ) -> candle_core::Result<candle_core::Tensor> {
        candle_core::Tensor::from_vec(
            self.dropout_mask(like.elem_count(), p),
            like.shape(),
            like.device(),
        )?
        .to_dtype(like.dtype())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(step: u64, stage: u64, call: u64) -> RngKey {
        RngKey { seed: 7, step, stage, call, pass: 0 }
    }

    #[test]
    fn same_key_same_draws_other_keys_differ() {
        let a = key(1, 2, 0).uniform(1000);
        assert_eq!(a, key(1, 2, 0).uniform(1000));
        for other in [key(2, 2, 0), key(1, 3, 0), key(1, 2, 1)] {
            let b = other.uniform(1000);
            assert!(a.iter().zip(&b).filter(|(x, y)| x != y).count() > 990);
        }
    }

    #[test]
    fn a_stream_drawn_in_pieces_equals_the_whole() {
        let whole = key(3, 1, 4).uniform(1001);
        let mut pieces = vec![0f32; 1001];
        let (a, b) = pieces.split_at_mut(333); // an odd split: a piece starts mid-word
        key(3, 1, 4).uniform_into(0, a);
        key(3, 1, 4).uniform_into(333, b);
        assert_eq!(whole, pieces);
    }

    #[test]
    fn derived_seeds_keep_stream_0_and_differ_elsewhere() {
        assert_eq!(derive_seed(7, 0), 7);
        let seeds: std::collections::HashSet<u64> = (0..64).map(|s| derive_seed(7, s)).collect();
        assert_eq!(seeds.len(), 64);
    }

    #[test]
    fn uniform_and_dropout_have_the_right_statistics() {
        let u = key(0, 0, 0).uniform(100_000);
        let mean = u.iter().sum::<f32>() / u.len() as f32;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
        assert!(u.iter().all(|&x| (0.0..1.0).contains(&x)));
        let m = key(0, 0, 1).dropout_mask(100_000, 0.1);
        let dropped = m.iter().filter(|&&x| x == 0.0).count() as f32 / m.len() as f32;
        assert!((dropped - 0.1).abs() < 0.01, "dropped {dropped}");
        let n = key(0, 0, 2).normal(100_000, 0.0, 2.0);
        let var = n.iter().map(|x| x * x).sum::<f32>() / n.len() as f32;
        assert!((var - 4.0).abs() < 0.1, "var {var}");
    }
}
