//! Flat token files and deterministic batching.

use crate::SplitMix;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("token file {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("token file {path} is empty")]
    Empty { path: String },
    #[error("token file {path} has {len} bytes, an odd number: u16 tokens take 2 bytes each")]
    OddLength { path: String, len: usize },
    #[error("{have} tokens are too few for windows of {need} (sequence length + 1)")]
    TooShort { have: usize, need: usize },
    #[error("token {token} at position {pos} is outside the vocabulary of {vocab}")]
    OutOfVocab { token: u32, pos: usize, vocab: usize },
    #[error("the text has no tokens")]
    NoDocuments,
    #[error("the padding's target id {ignore} is inside the vocabulary of {vocab}")]
    IgnoreInVocab { ignore: u32, vocab: usize },
}

/// Refuses the first of `ids` (with its position among them) outside a vocabulary of `vocab`.
fn check_vocab<'a>(ids: impl IntoIterator<Item = &'a u32>, vocab: usize) -> Result<(), DataError> {
    match ids.into_iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
        Some((pos, &token)) => Err(DataError::OutOfVocab { token, pos, vocab }),
        None => Ok(()),
    }
}

/// Reads a flat file of u16 little-endian token ids, as the ids they are.
pub fn load_u16(path: &Path) -> Result<Vec<u32>, DataError> {
    let p = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| DataError::Io { path: p.clone(), source })?;
    if bytes.is_empty() {
        return Err(DataError::Empty { path: p });
    }
    if bytes.len() % 2 != 0 {
        return Err(DataError::OddLength { path: p, len: bytes.len() });
    }
    Ok(bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]).into()).collect())
}

/// Writes tokens in the same format.
pub fn save_u16(path: &Path, tokens: &[u16]) -> std::io::Result<()> {
    std::fs::write(path, tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>())
}

/// Cuts random (input, target) windows out of a token stream: targets are inputs shifted by one.
/// Ids are 32-bit: Llama 3's and Qwen's vocabularies are above 65,535.
#[derive(Debug)]
pub struct Batcher {
    tokens: Vec<u32>,
    seq: usize,
    seed: u64,
}

impl Batcher {
    pub fn new(tokens: Vec<u32>, seq: usize, vocab: usize, seed: u64) -> Result<Self, DataError> {
        if tokens.len() < seq + 1 {
            return Err(DataError::TooShort { have: tokens.len(), need: seq + 1 });
        }
        check_vocab(&tokens, vocab)?;
        Ok(Batcher { tokens, seq, seed })
    }

    /// Windows of `seq` over the byte tokens of the built-in synthetic corpus (256 KiB): a causal
    /// language model's synthetic data (GPT-2's and the Llama family's, in the harness).
    pub fn synthetic(seq: usize, vocab: usize, seed: u64) -> Result<Self, DataError> {
        let text = crate::text::synthetic_corpus(seed, 1 << 18);
        Batcher::new(crate::text::byte_tokens(&text), seq, vocab, seed)
    }

    /// How many distinct windows the stream holds (one per start).
    pub fn windows(&self) -> usize {
        self.tokens.len() - self.seq
    }

    /// The batch of `step`: `batch` windows, each flattened row-major, as (inputs, targets).
    pub fn batch(&self, step: u64, batch: usize) -> (Vec<u32>, Vec<u32>) {
        let mut rng = SplitMix::new(self.seed ^ step.wrapping_mul(0xD1B5_4A32_D192_ED03));
        let (mut x, mut y) =
            (Vec::with_capacity(batch * self.seq), Vec::with_capacity(batch * self.seq));
        for _ in 0..batch {
            let start = rng.below(self.tokens.len() - self.seq);
            let w = &self.tokens[start..start + self.seq + 1];
            x.extend_from_slice(&w[..self.seq]);
            y.extend_from_slice(&w[1..]);
        }
        (x, y)
    }
}

/// Examples of different lengths (documents cut to at most `max_len` tokens), drawn for a step
/// without replacement: each epoch visits every example once, in an order fixed by the seed.
#[derive(Debug)]
pub struct Examples {
    examples: Vec<Vec<u32>>,
    seed: u64,
}

impl Examples {
    /// Documents longer than `max_len` are cut into consecutive pieces; empty ones are dropped.
    pub fn new(documents: Vec<Vec<u32>>, max_len: usize, seed: u64) -> Result<Self, DataError> {
        let examples: Vec<Vec<u32>> =
            documents.iter().flat_map(|d| d.chunks(max_len.max(1)).map(<[u32]>::to_vec)).collect();
        if examples.is_empty() {
            return Err(DataError::NoDocuments);
        }
        Ok(Examples { examples, seed })
    }

    pub fn len(&self) -> usize {
        self.examples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.examples.is_empty()
    }

    /// The `batch` examples of `step`: positions `step * batch ..` of the epochs' orders.
    pub fn batch(&self, step: u64, batch: usize) -> Vec<&[u32]> {
        let n = self.examples.len() as u64;
        let mut order: Option<(u64, Vec<usize>)> = None;
        (0..batch as u64)
            .map(|i| {
                let at = step * batch as u64 + i;
                let epoch = at / n;
                if order.as_ref().is_none_or(|(e, _)| *e != epoch) {
                    order = Some((epoch, self.order(epoch)));
                }
                let (_, perm) = order.as_ref().expect("just set");
                self.examples[perm[(at % n) as usize]].as_slice()
            })
            .collect()
    }

    /// A Fisher-Yates shuffle of the examples for `epoch`.
    fn order(&self, epoch: u64) -> Vec<usize> {
        let mut rng = SplitMix::new(self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5EED);
        let mut perm: Vec<usize> = (0..self.examples.len()).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, rng.below(i + 1));
        }
        perm
    }
}

/// A causal language model's examples of different lengths (one per document, or per piece of a
/// long one), each right-padded to `seq` positions: the targets at the padding are `ignore`, an id
/// the loss skips. With the causal mask no real position attends to the padding after it, so no
/// attention mask is needed.
#[derive(Debug)]
pub struct Padded {
    examples: Examples,
    seq: usize,
    ignore: u32,
}

impl Padded {
    /// Documents cut into pieces of at most `seq + 1` tokens that overlap by one, so that every
    /// pair of neighbours is predicted exactly once; a document of one token (no pair) is dropped.
    /// `ignore` lies outside the vocabulary, so that no token reads as padding.
    pub fn new(
        documents: Vec<Vec<u32>>,
        seq: usize,
        vocab: usize,
        ignore: u32,
        seed: u64,
    ) -> Result<Self, DataError> {
        if (ignore as usize) < vocab {
            return Err(DataError::IgnoreInVocab { ignore, vocab });
        }
        check_vocab(documents.iter().flatten(), vocab)?;
        let examples: Vec<Vec<u32>> = documents
            .iter()
            .flat_map(|d| {
                (0..d.len().saturating_sub(1))
                    .step_by(seq.max(1))
                    .map(move |start| d[start..(start + seq + 1).min(d.len())].to_vec())
            })
            .collect();
        if examples.is_empty() {
            return Err(DataError::NoDocuments);
        }
        Ok(Padded { examples: Examples { examples, seed }, seq, ignore })
    }

    /// How many examples (pieces) it holds.
    pub fn len(&self) -> usize {
        self.examples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.examples.is_empty()
    }

    /// The batch of `step` as (inputs, targets), each `batch * seq` row-major: an example of n
    /// tokens gives its first n - 1 as inputs and its last n - 1 as targets, then padding (input
    /// id 0, target `ignore`).
    pub fn batch(&self, step: u64, batch: usize) -> (Vec<u32>, Vec<u32>) {
        let (mut x, mut y) =
            (Vec::with_capacity(batch * self.seq), Vec::with_capacity(batch * self.seq));
        for example in self.examples.batch(step, batch) {
            let n = example.len() - 1; // (input, target) pairs, 1..=seq
            x.extend_from_slice(&example[..n]);
            y.extend_from_slice(&example[1..]);
            x.resize(x.len() + self.seq - n, 0);
            y.resize(y.len() + self.seq - n, self.ignore);
        }
        (x, y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_bad_files() {
        let dir = std::env::temp_dir().join(format!("datasets-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ok = dir.join("ok.bin");
        save_u16(&ok, &[1, 2, 50256]).unwrap();
        assert_eq!(load_u16(&ok).unwrap(), vec![1, 2, 50256]);
        let empty = dir.join("empty.bin");
        std::fs::write(&empty, b"").unwrap();
        assert!(load_u16(&empty).unwrap_err().to_string().contains("is empty"));
        let odd = dir.join("odd.bin");
        std::fs::write(&odd, b"abc").unwrap();
        assert!(load_u16(&odd).unwrap_err().to_string().contains("odd number"));
        assert!(load_u16(&dir.join("missing.bin")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn batches_are_shifted_windows() {
        let tokens: Vec<u32> = (0..1000).map(|i| i % 200).collect();
        let b = Batcher::new(tokens, 16, 256, 1).unwrap();
        let (x, y) = b.batch(5, 3);
        assert_eq!((x.len(), y.len()), (48, 48));
        for (a, t) in x.iter().zip(&y) {
            assert_eq!((a + 1) % 200, *t);
        }
        assert_eq!(b.batch(5, 3), (x.clone(), y));
        assert_ne!(b.batch(6, 3).0, x);
        assert!(Batcher::new(vec![1; 10], 16, 256, 1).is_err());
        assert!(Batcher::new(vec![300; 100], 16, 256, 1)
            .unwrap_err()
            .to_string()
            .contains("vocabulary"));
    }

    #[test]
    fn examples_visit_every_piece_once_per_epoch() {
        let docs = vec![vec![1, 2, 3, 4, 5], vec![], vec![6], vec![7, 8]];
        let ex = Examples::new(docs, 2, 3).unwrap();
        assert_eq!(ex.len(), 5, "[1 2] [3 4] [5] [6] [7 8]");
        let epoch: Vec<Vec<u32>> =
            (0..5).flat_map(|s| ex.batch(s, 1)).map(<[u32]>::to_vec).collect();
        let mut sorted = epoch.clone();
        sorted.sort();
        assert_eq!(sorted, vec![vec![1, 2], vec![3, 4], vec![5], vec![6], vec![7, 8]]);
        assert_eq!(
            ex.batch(1, 2),
            epoch[2..4].iter().map(Vec::as_slice).collect::<Vec<_>>(),
            "a batch of 2 at step 1 is epoch positions 2 and 3"
        );
        assert_eq!(ex.batch(2, 3).len(), 3, "a batch runs across the end of an epoch");
        assert!(Examples::new(vec![vec![]], 4, 0).is_err());
    }

    #[test]
    fn padded_examples_predict_each_pair_once_and_ignore_the_padding() {
        const IGNORE: u32 = u32::MAX;
        // seq 3: [1 2 3 4 5 6] gives [1 2 3 4] and [4 5 6]; [7] has no pair; [8 9] is one.
        let docs = vec![vec![1, 2, 3, 4, 5, 6], vec![7], vec![8, 9]];
        let data = Padded::new(docs, 3, 16, IGNORE, 3).unwrap();
        assert_eq!(data.len(), 3);
        let mut rows: Vec<(Vec<u32>, Vec<u32>)> = (0..3)
            .map(|step| {
                let (x, y) = data.batch(step, 1);
                (x, y)
            })
            .collect();
        rows.sort();
        assert_eq!(
            rows,
            vec![
                (vec![1, 2, 3], vec![2, 3, 4]),
                (vec![4, 5, 0], vec![5, 6, IGNORE]),
                (vec![8, 0, 0], vec![9, IGNORE, IGNORE]),
            ]
        );
        let (x, y) = data.batch(7, 4);
        assert_eq!((x.len(), y.len()), (12, 12));
        assert!(Padded::new(vec![vec![7]], 3, 16, IGNORE, 0).is_err(), "no pair at all");
        let err = Padded::new(vec![vec![1, 20]], 3, 16, IGNORE, 0).unwrap_err().to_string();
        assert!(err.contains("token 20 at position 1"), "{err}");
        let err = Padded::new(vec![vec![1, 2]], 3, 16, 7, 0).unwrap_err().to_string();
        assert!(err.contains("target id 7 is inside the vocabulary of 16"), "{err}");
    }
}
