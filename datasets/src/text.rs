//! A synthetic English-like corpus with learnable structure.

use crate::SplitMix;

const NAMES: &[&str] = &["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"];
const ADJECTIVES: &[&str] = &["small", "red", "quiet", "old", "bright", "heavy", "green", "quick"];
const NOUNS: &[&str] = &["cat", "dog", "bird", "apple", "stone", "book", "boat", "lamp"];
const VERBS: &[&str] = &["sees", "finds", "likes", "carries", "paints", "counts", "moves", "keeps"];
const PLACES: &[&str] = &["garden", "river", "market", "tower", "forest", "harbor"];

fn sentence(rng: &mut SplitMix) -> String {
    match rng.below(4) {
        0 => format!(
            "{} {} the {} {}.",
            rng.pick(NAMES),
            rng.pick(VERBS),
            rng.pick(ADJECTIVES),
            rng.pick(NOUNS)
        ),
        1 => {
            let (a, b) = (rng.below(50), rng.below(50));
            format!("{a} plus {b} is {}.", a + b)
        }
        2 => format!(
            "the {} {} is in the {}.",
            rng.pick(ADJECTIVES),
            rng.pick(NOUNS),
            rng.pick(PLACES)
        ),
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
pub fn byte_tokens(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
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
            let (x, y, z): (u32, u32, u32) =
                (w[0].parse().unwrap(), w[2].parse().unwrap(), w[4].parse().unwrap());
            assert_eq!(x + y, z, "{s}");
        }
    }
}

/// A whole-word vocabulary: BERT's special tokens, then words. Built from a corpus (the default
/// data) or read from a vocabulary file with one token per line (a WordPiece `vocab.txt`, used for
/// whole words only; anything else becomes `[UNK]`).
#[derive(Clone, Debug)]
pub struct WordVocab {
    tokens: Vec<String>,
    index: std::collections::HashMap<String, u32>,
}

pub const SPECIAL_TOKENS: [&str; 5] = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"];

/// Lower-cased words, with `.` and `,` as words of their own.
fn words(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split_whitespace().flat_map(|w| {
        let w = w.to_lowercase();
        let (stem, punct) = match w.strip_suffix(['.', ',']) {
            Some(s) => (s.to_string(), Some(w[s.len()..].to_string())),
            None => (w, None),
        };
        std::iter::once(stem).chain(punct).filter(|s| !s.is_empty())
    })
}

impl WordVocab {
    pub fn build(text: &str) -> Self {
        let mut seen: Vec<String> = words(text).collect();
        seen.sort();
        seen.dedup();
        Self::from_tokens(SPECIAL_TOKENS.iter().map(|s| s.to_string()).chain(seen).collect())
    }

    pub fn from_file(path: &std::path::Path) -> std::io::Result<Self> {
        let tokens: Vec<String> =
            std::fs::read_to_string(path)?.lines().map(|l| l.trim().to_string()).collect();
        let missing: Vec<&str> =
            SPECIAL_TOKENS.iter().copied().filter(|s| !tokens.iter().any(|t| t == s)).collect();
        if !missing.is_empty() {
            let msg = format!("vocabulary {} lacks the special tokens {missing:?}", path.display());
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, msg));
        }
        Ok(Self::from_tokens(tokens))
    }

    fn from_tokens(tokens: Vec<String>) -> Self {
        let index = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        WordVocab { tokens, index }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The id of a token; specials are always present.
    pub fn id(&self, token: &str) -> Option<u32> {
        self.index.get(token).copied()
    }

    pub fn special(&self, token: &str) -> u32 {
        self.id(token).expect("special tokens are in every vocabulary")
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.tokens.get(id as usize).is_some_and(|t| SPECIAL_TOKENS.contains(&t.as_str()))
    }

    pub fn encode(&self, text: &str) -> Vec<u32> {
        let unk = self.special("[UNK]");
        words(text).map(|w| self.id(&w).unwrap_or(unk)).collect()
    }
}

#[cfg(test)]
mod vocab_tests {
    use super::*;

    #[test]
    fn words_round_trip_through_the_vocabulary() {
        let v = WordVocab::build("The cat sees 3 dogs. The dog, too.");
        assert_eq!(&v.tokens[..5], SPECIAL_TOKENS);
        let ids = v.encode("the cat. zebra");
        assert_eq!(ids.len(), 4);
        assert_eq!(ids[2], v.id(".").unwrap());
        assert_eq!(ids[3], v.special("[UNK]"));
        assert!(v.is_special(v.special("[MASK]")) && !v.is_special(ids[0]));
    }
}
