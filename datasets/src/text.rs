//! A synthetic English-like corpus with learnable structure.

use crate::SplitMix;

const NAMES: &[&str] = &["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"];
const ADJECTIVES: &[&str] = &["small", "red", "quiet", "old", "bright", "heavy", "green", "quick"];
const NOUNS: &[&str] = &["cat", "dog", "bird", "apple", "stone", "book", "boat", "lamp"];
const VERBS: &[&str] = &["sees", "finds", "likes", "carries", "paints", "counts", "moves", "keeps"];
const PLACES: &[&str] = &["garden", "river", "market", "tower", "forest", "harbor"];

fn sentence(rng: &mut SplitMix) -> String {
    match rng.below(4) {
        0 => format!("{} {} the {} {}.", rng.pick(NAMES), rng.pick(VERBS), rng.pick(ADJECTIVES), rng.pick(NOUNS)),
        1 => {
            let (a, b) = (rng.below(50), rng.below(50));
            format!("{a} plus {b} is {}.", a + b)
        }
        2 => format!("the {} {} is in the {}.", rng.pick(ADJECTIVES), rng.pick(NOUNS), rng.pick(PLACES)),
        _ => {
            let n = 2 + rng.below(7);
            format!("{} gives {} {n} {}s.", rng.pick(NAMES), rng.pick(NAMES), rng.pick(NOUNS))
        }
    }
}

/// At least `min_bytes` of text: sentences separated by spaces, a newline every eight sentences.
pub fn synthetic_corpus(seed: u64, min_bytes: usize) -> String {
    let mut rng = SplitMix::new(seed);
    let mut out = String::with_capacity(min_bytes + 64);
    let mut i = 0;
    while out.len() < min_bytes {
        out.push_str(&sentence(&mut rng));
        i += 1;
        out.push(if i % 8 == 0 { '\n' } else { ' ' });
    }
    out
}

/// Byte-level tokens: every byte is its own token id (< 256).
pub fn byte_tokens(text: &str) -> Vec<u16> {
    text.bytes().map(u16::from).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corpus_is_deterministic_and_correct() {
        let a = synthetic_corpus(3, 10_000);
        assert_eq!(a, synthetic_corpus(3, 10_000));
        assert_ne!(a, synthetic_corpus(4, 10_000));
        assert!(a.len() >= 10_000);
        for s in a.split('.').map(str::trim).filter(|s| s.contains(" plus ")) {
            let w: Vec<&str> = s.split(' ').collect();
            let (x, y, z): (u32, u32, u32) = (w[0].parse().unwrap(), w[2].parse().unwrap(), w[4].parse().unwrap());
            assert_eq!(x + y, z, "{s}");
        }
    }
}
