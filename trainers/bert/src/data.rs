//! Masked-LM data: BERT's masking of a token sequence, and batches of it from a text.

use remat::rng::RngKey;

/// Why masked-LM data cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum MlmDataError {
    #[error("the vocabulary has {have} tokens, the model only {max} (vocab_size)")]
    VocabularyTooLarge { have: usize, max: usize },
    #[error("sequence length {0} is too short for [CLS] ... [SEP]")]
    SequenceTooShort(usize),
    #[error(transparent)]
    Tokens(#[from] datasets::tokens::DataError),
}

/// One masked-LM batch: inputs with 15% of the tokens masked, and what the loss scores.
pub struct MaskedBatch {
    pub input_ids: Vec<u32>,
    pub labels: Vec<u32>,
    pub weights: Vec<f32>,
}

/// BERT's masking: 15% of the non-special tokens are chosen; of those 80% become `[MASK]`, 10% a
/// random word, 10% stay. Every draw comes from `key`, so a step's masking is reproducible.
pub fn mask_tokens(ids: &[u32], key: RngKey, vocab_size: usize, mask_id: u32, is_special: impl Fn(u32) -> bool) -> MaskedBatch {
    let u = key.uniform(3 * ids.len());
    let mut out = MaskedBatch { input_ids: ids.to_vec(), labels: ids.to_vec(), weights: vec![0.0; ids.len()] };
    for (i, &id) in ids.iter().enumerate() {
        if is_special(id) || u[3 * i] >= 0.15 {
            continue;
        }
        out.weights[i] = 1.0;
        let r = u[3 * i + 1];
        if r < 0.8 {
            out.input_ids[i] = mask_id;
        } else if r < 0.9 {
            out.input_ids[i] = ((u[3 * i + 2] * vocab_size as f32) as u32).min(vocab_size as u32 - 1);
        }
    }
    if let (false, Some(i)) = (out.weights.contains(&1.0), ids.iter().position(|&id| !is_special(id))) {
        // Never an empty loss: score at least one token.
        out.weights[i] = 1.0;
        out.input_ids[i] = mask_id;
    }
    out
}

/// Masked-LM batches from a text: whole-word tokens, `[CLS] window [SEP]` sequences, BERT masking.
pub struct MlmData {
    pub vocab: datasets::text::WordVocab,
    windows: datasets::tokens::Batcher,
    vocab_size: usize,
    seq: usize,
    seed: u64,
}

impl MlmData {
    /// `vocab_size` is the model's; the text's vocabulary must fit in it.
    pub fn new(text: &str, vocab: datasets::text::WordVocab, vocab_size: usize, seq: usize, seed: u64) -> Result<Self, MlmDataError> {
        if vocab.len() > vocab_size {
            return Err(MlmDataError::VocabularyTooLarge { have: vocab.len(), max: vocab_size });
        }
        if seq < 3 {
            return Err(MlmDataError::SequenceTooShort(seq));
        }
        let ids: Vec<u16> = vocab.encode(text).into_iter().map(|i| i as u16).collect();
        let windows = datasets::tokens::Batcher::new(ids, seq - 2, vocab_size, seed)?;
        Ok(MlmData { vocab, windows, vocab_size, seq, seed })
    }

    /// The default data: the synthetic corpus with its own word vocabulary.
    pub fn synthetic(vocab_size: usize, seq: usize, seed: u64) -> Result<Self, MlmDataError> {
        let text = datasets::text::synthetic_corpus(seed, 1 << 19);
        let vocab = datasets::text::WordVocab::build(&text);
        Self::new(&text, vocab, vocab_size, seq, seed)
    }

    pub fn batch(&self, step: u64, batch: usize) -> MaskedBatch {
        let (cls, sep) = (self.vocab.special("[CLS]"), self.vocab.special("[SEP]"));
        let (windows, _) = self.windows.batch(step, batch);
        let ids: Vec<u32> = windows.chunks(self.seq - 2).flat_map(|w| std::iter::once(cls).chain(w.iter().copied()).chain([sep])).collect();
        let key = RngKey { step, ..RngKey::named(self.seed, "mlm-mask") };
        mask_tokens(&ids, key, self.vocab.len().min(self.vocab_size), self.vocab.special("[MASK]"), |id| self.vocab.is_special(id))
    }
}
