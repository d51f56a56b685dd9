//! `datasets`: deterministic training data that needs no network, and loaders for common formats.
//!
//! - [`images::SyntheticImages`]: gratings whose orientation, frequency and colour give the class.
//! - [`text::synthetic_corpus`]: English-like text from a small grammar (subjects, verbs, objects,
//!   and arithmetic facts whose answers are right), so a language model has real structure to
//!   learn; byte-level tokens ([`text::byte_tokens`]) make it usable with any GPT-2 vocabulary.
//! - [`volumes::SyntheticVolumes`]: spheres and cubes to segment; [`volumes::NpyVolumes`]: `.npy`
//!   volumes.
//! - [`tokens::load_u16`]: flat token files (u16 little-endian, the usual GPT-2 preprocessing).
//! - [`tokens::Batcher`]: deterministic (input, target) windows for a step; [`tokens::Examples`]:
//!   documents of different lengths, each once per epoch.
//! - [`tokenizer::Tokenizer`]: text through a Hugging Face `tokenizer.json` (WordPiece, BPE).
//!
//! Everything is a pure function of its seed: the same seed gives the same bytes on every machine.

pub mod images;
pub mod text;
pub mod tokenizer;
pub mod tokens;
pub mod volumes;

/// A tiny counter-based generator (SplitMix64), so data needs no RNG crate and no global state.
#[derive(Clone, Debug)]
pub struct SplitMix(u64);

impl SplitMix {
    pub fn new(seed: u64) -> Self {
        SplitMix(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}
