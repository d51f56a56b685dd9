//! Masked-LM data: BERT's masking of token sequences, and batches of them from the synthetic
//! corpus or a text file (whole words, or a `tokenizer.json`).

use datasets::text::WordVocab;
use datasets::tokenizer::Tokenizer;
use datasets::tokens::{Batcher, Examples};
use remat::rng::RngKey;

/// Why masked-LM data cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum MlmDataError {
    #[error("the vocabulary has {have} tokens, the model only {max} (vocab_size)")]
    VocabularyTooLarge { have: usize, max: usize },
    #[error("sequence length {0} is too short for [CLS] ... [SEP]")]
    SequenceTooShort(usize),
    #[error("tokenizer {path} has no {token} token, which BERT's masked-LM data needs")]
    MissingSpecial { path: String, token: &'static str },
    #[error(
        "no document has a token to predict: every one holds special tokens only ([UNK], [PAD], \
         ...)"
    )]
    NothingToPredict,
    #[error(transparent)]
    Tokens(#[from] datasets::tokens::DataError),
    #[error(transparent)]
    Tokenizer(#[from] datasets::tokenizer::TokenizerError),
}

/// One masked-LM batch of `batch` sequences of `seq` tokens (row-major): inputs with 15% of the
/// tokens masked, what the loss scores, and the padding.
pub struct MaskedBatch {
    pub batch: usize,
    pub seq: usize,
    pub input_ids: Vec<u32>,
    /// Segment A (0) or B (1) of every token.
    pub token_types: Vec<u32>,
    /// 1 for a token, 0 for padding.
    pub attention_mask: Vec<f32>,
    pub labels: Vec<u32>,
    /// 1 at masked positions, 0 elsewhere.
    pub weights: Vec<f32>,
}

/// BERT's masking: 15% of the non-special tokens are chosen; of those 80% become `[MASK]`, 10% a
/// random word (an id below `vocab_size`), 10% stay. Every draw comes from `key`, so a step's
/// masking is reproducible. `ids` holds rows of `row_len` tokens; a row where no token was chosen
/// has its first non-special token masked, so that every row (and so every data-parallel rank's
/// share of a batch) has a position to score. Returns (input ids, labels, weights).
pub fn mask_tokens(
    ids: &[u32],
    row_len: usize,
    key: RngKey,
    vocab_size: usize,
    mask_id: u32,
    is_special: impl Fn(u32) -> bool,
) -> (Vec<u32>, Vec<u32>, Vec<f32>) {
    let u = key.uniform(3 * ids.len());
    let (mut input_ids, mut weights) = (ids.to_vec(), vec![0.0; ids.len()]);
    for (i, &id) in ids.iter().enumerate() {
        if is_special(id) || u[3 * i] >= 0.15 {
            continue;
        }
        weights[i] = 1.0;
        let r = u[3 * i + 1];
        if r < 0.8 {
            input_ids[i] = mask_id;
        } else if r < 0.9 {
            input_ids[i] = ((u[3 * i + 2] * vocab_size as f32) as u32).min(vocab_size as u32 - 1);
        }
    }
    for start in (0..ids.len()).step_by(row_len.max(1)) {
        let row = start..(start + row_len).min(ids.len());
        if let (false, Some(i)) = (
            weights[row.clone()].contains(&1.0),
            ids[row.clone()].iter().position(|&id| !is_special(id)),
        ) {
            weights[start + i] = 1.0;
            input_ids[start + i] = mask_id;
        }
    }
    (input_ids, ids.to_vec(), weights)
}

/// The special tokens masked-LM data uses, by id.
#[derive(Clone, Debug)]
pub struct Specials {
    pub cls: u32,
    pub sep: u32,
    pub mask: u32,
    pub pad: u32,
    /// These four and `[UNK]` where the vocabulary has it: never masked, never scored.
    all: Vec<u32>,
}

impl Specials {
    fn new([cls, sep, mask, pad]: [u32; 4], unk: Option<u32>) -> Self {
        Specials {
            cls,
            sep,
            mask,
            pad,
            all: [cls, sep, mask, pad].into_iter().chain(unk).collect(),
        }
    }

    fn of_words(vocab: &WordVocab) -> Self {
        Self::new(
            ["[CLS]", "[SEP]", "[MASK]", "[PAD]"].map(|t| vocab.special(t)),
            vocab.id("[UNK]"),
        )
    }

    fn of_tokenizer(tok: &Tokenizer) -> Result<Self, MlmDataError> {
        let id = |token| {
            tok.token_id(token)
                .ok_or_else(|| MlmDataError::MissingSpecial { path: tok.path().to_string(), token })
        };
        Ok(Self::new(
            [id("[CLS]")?, id("[SEP]")?, id("[MASK]")?, id("[PAD]")?],
            tok.token_id("[UNK]"),
        ))
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.all.contains(&id)
    }
}

/// Where sequences come from.
enum Source {
    /// Full-length windows of one token stream (the synthetic corpus: every batch `seq` long).
    Stream(Batcher),
    /// One example per document (line), cut to fit; batches padded to their longest.
    Documents(Examples),
}

/// Masked-LM batches: `[CLS] tokens [SEP]` sequences with BERT's masking.
pub struct MlmData {
    source: Source,
    pub specials: Specials,
    /// Tokens in the data's vocabulary (random replacements are drawn below it).
    pub vocab_len: usize,
    seq: usize,
    seed: u64,
}

impl MlmData {
    /// The default data: windows of the synthetic corpus with its own word vocabulary.
    pub fn synthetic(vocab_size: usize, seq: usize, seed: u64) -> Result<Self, MlmDataError> {
        let text = datasets::text::synthetic_corpus(seed, 1 << 19);
        let vocab = WordVocab::build(&text);
        check(vocab.len(), vocab_size, seq)?;
        let ids = vocab.encode(&text);
        let source = Source::Stream(Batcher::new(ids, seq - 2, vocab_size, seed)?);
        Ok(MlmData {
            source,
            specials: Specials::of_words(&vocab),
            vocab_len: vocab.len(),
            seq,
            seed,
        })
    }

    /// A text file, one document per line, in whole words of `vocab` (`vocab_size` is the model's).
    pub fn words(
        text: &str,
        vocab: &WordVocab,
        vocab_size: usize,
        seq: usize,
        seed: u64,
    ) -> Result<Self, MlmDataError> {
        check(vocab.len(), vocab_size, seq)?;
        let docs = text.lines().map(|l| vocab.encode(l)).collect();
        Self::documents(docs, Specials::of_words(vocab), vocab.len(), seq, seed)
    }

    /// A text file, one document per line, through a tokenizer (`vocab_size` is the model's).
    pub fn tokenized(
        text: &str,
        tokenizer: &Tokenizer,
        vocab_size: usize,
        seq: usize,
        seed: u64,
    ) -> Result<Self, MlmDataError> {
        check(tokenizer.vocab_size(), vocab_size, seq)?;
        let specials = Specials::of_tokenizer(tokenizer)?;
        Self::documents(tokenizer.encode_lines(text)?, specials, tokenizer.vocab_size(), seq, seed)
    }

    fn documents(
        docs: Vec<Vec<u32>>,
        specials: Specials,
        vocab_len: usize,
        seq: usize,
        seed: u64,
    ) -> Result<Self, MlmDataError> {
        // Cut here rather than in `Examples`, to drop the pieces with nothing to predict (only
        // special tokens: `[UNK]`s, or a literal `[PAD]` in the text): a batch of them would have
        // no position to score.
        let pieces: Vec<Vec<u32>> = docs
            .iter()
            .flat_map(|d| d.chunks(seq - 2))
            .filter(|p| p.iter().any(|&id| !specials.is_special(id)))
            .map(<[u32]>::to_vec)
            .collect();
        if pieces.is_empty() {
            return Err(MlmDataError::NothingToPredict);
        }
        let source = Source::Documents(Examples::new(pieces, seq - 2, seed)?);
        Ok(MlmData { source, specials, vocab_len, seq, seed })
    }

    /// How many distinct samples it holds: windows of the stream, or documents' pieces.
    pub fn samples(&self) -> usize {
        match &self.source {
            Source::Stream(windows) => windows.windows(),
            Source::Documents(docs) => docs.len(),
        }
    }

    /// The masked batch of `step`: `[CLS] example [SEP]` rows, padded with `[PAD]` to the
    /// longest row (masked out of attention, never scored).
    pub fn batch(&self, step: u64, batch: usize) -> MaskedBatch {
        self.padded_batch(step, batch, 0)
    }

    /// [`MlmData::batch`] padded to the full sequence length: as large as a batch of this data
    /// can be, which is what a memory plan must fit.
    pub fn full_length_batch(&self, step: u64, batch: usize) -> MaskedBatch {
        self.padded_batch(step, batch, self.seq)
    }

    fn padded_batch(&self, step: u64, batch: usize, min_len: usize) -> MaskedBatch {
        let examples: Vec<&[u32]> = match &self.source {
            Source::Stream(windows) => {
                let (ids, _) = windows.batch(step, batch);
                return self.frame(step, ids.chunks(self.seq - 2).collect(), min_len);
            }
            Source::Documents(docs) => docs.batch(step, batch),
        };
        self.frame(step, examples, min_len)
    }

    fn frame(&self, step: u64, examples: Vec<&[u32]>, min_len: usize) -> MaskedBatch {
        let s = &self.specials;
        let seq = examples.iter().map(|e| e.len() + 2).max().unwrap_or(2).max(min_len);
        let (mut ids, mut attention_mask) =
            (Vec::with_capacity(examples.len() * seq), Vec::with_capacity(examples.len() * seq));
        for e in &examples {
            ids.push(s.cls);
            ids.extend_from_slice(e);
            ids.push(s.sep);
            ids.extend(std::iter::repeat_n(s.pad, seq - e.len() - 2));
            attention_mask.extend((0..seq).map(|i| if i < e.len() + 2 { 1.0 } else { 0.0 }));
        }
        let key = RngKey { step, ..RngKey::named(self.seed, "mlm-mask") };
        let (input_ids, labels, weights) =
            mask_tokens(&ids, seq, key, self.vocab_len, s.mask, |id| s.is_special(id));
        MaskedBatch {
            batch: examples.len(),
            seq,
            token_types: vec![0; ids.len()],
            attention_mask,
            input_ids,
            labels,
            weights,
        }
    }
}

fn check(vocab_len: usize, vocab_size: usize, seq: usize) -> Result<(), MlmDataError> {
    if vocab_len > vocab_size {
        return Err(MlmDataError::VocabularyTooLarge { have: vocab_len, max: vocab_size });
    }
    if seq < 3 {
        return Err(MlmDataError::SequenceTooShort(seq));
    }
    Ok(())
}
