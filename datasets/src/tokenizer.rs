//! Text through a Hugging Face `tokenizer.json`, read by the `tokenizers` crate: BERT's WordPiece,
//! GPT-2's byte-level BPE, or any other model the file describes.

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("tokenizer {path}: {message}")]
    Read { path: String, message: String },
    #[error("tokenizer {path} cannot encode the text: {message}")]
    Encode { path: String, message: String },
}

/// The two kinds of tokenizer [`Tokenizer::train`] makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// BERT's: lower-casing, split on whitespace and punctuation, WordPiece with `##`
    /// continuations, the special tokens `[PAD] [UNK] [CLS] [SEP] [MASK]`.
    WordPiece,
    /// GPT-2's: byte-level BPE over every byte, and `<|endoftext|>`.
    ByteLevelBpe,
}

/// A tokenizer read from a `tokenizer.json`. It encodes without the special tokens its
/// post-processor would add: the data code frames sequences itself (BERT's `[CLS] ... [SEP]`).
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: String,
}

impl Tokenizer {
    /// Reads a `tokenizer.json`, with its padding and truncation turned off: published files
    /// often carry both (pad and cut every text to 128 ids), and the data code splits long
    /// documents and pads batches itself (with an attention mask) instead.
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        let p = path.display().to_string();
        let read = |message: String| TokenizerError::Read { path: p.clone(), message };
        let text = std::fs::read_to_string(path).map_err(|e| read(e.to_string()))?;
        let mut inner: tokenizers::Tokenizer = text.parse().map_err(|e| {
            let is_json = serde_json::from_str::<serde_json::Value>(&text).is_ok();
            let what = if is_json {
                "JSON, but not a Hugging Face tokenizer.json"
            } else {
                "not a Hugging Face tokenizer.json (not even JSON)"
            };
            read(format!("{what}: {e}"))
        })?;
        inner.with_padding(None);
        inner.with_truncation(None).map_err(|e| read(e.to_string()))?;
        Ok(Tokenizer { inner, path: p })
    }

    /// Learns a tokenizer of `kind` with at most `vocab_size` tokens from the lines of `text`,
    /// and writes it to `path` as a `tokenizer.json`: for a corpus without a published tokenizer,
    /// and for tests, which must not download one.
    pub fn train(
        kind: Kind,
        text: &str,
        vocab_size: usize,
        path: &Path,
    ) -> Result<Self, TokenizerError> {
        use tokenizers::models::{bpe::BpeTrainer, wordpiece::WordPieceTrainer, TrainerWrapper};
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        use tokenizers::AddedToken;
        let special = |names: &[&str]| {
            names.iter().map(|t| AddedToken::from(t.to_string(), true)).collect::<Vec<_>>()
        };
        let (mut tokenizer, mut trainer): (tokenizers::Tokenizer, TrainerWrapper) = match kind {
            Kind::WordPiece => {
                let mut t =
                    tokenizers::Tokenizer::new(tokenizers::models::wordpiece::WordPiece::default());
                t.with_normalizer(Some(tokenizers::normalizers::BertNormalizer::default()))
                    .expect("a normalizer is always accepted");
                t.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::bert::BertPreTokenizer));
                t.with_decoder(Some(tokenizers::decoders::wordpiece::WordPiece::default()));
                let trainer = WordPieceTrainer::builder()
                    .vocab_size(vocab_size)
                    .show_progress(false)
                    .special_tokens(special(&["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
                    .build();
                (t, trainer.into())
            }
            Kind::ByteLevelBpe => {
                let mut t = tokenizers::Tokenizer::new(tokenizers::models::bpe::BPE::default());
                t.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
                t.with_decoder(Some(ByteLevel::default()));
                let trainer = BpeTrainer::builder()
                    .vocab_size(vocab_size)
                    .show_progress(false)
                    .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
                    .special_tokens(special(&["<|endoftext|>"]))
                    .build();
                (t, trainer.into())
            }
        };
        let p = path.display().to_string();
        let failed = |e: tokenizers::Error| TokenizerError::Read {
            path: p.clone(),
            message: format!("training: {e}"),
        };
        tokenizer.train(&mut trainer, text.lines()).map_err(failed)?;
        tokenizer.save(path, false).map_err(failed)?;
        Self::from_file(path)
    }

    /// The file it was read from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Tokens in the vocabulary, added (special) tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The ids of `text`, in one piece.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self.inner.encode(text, false).map_err(|e| self.encode_error(e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The ids of every non-blank line of `text`: one document per line (encoded in parallel).
    pub fn encode_lines(&self, text: &str) -> Result<Vec<Vec<u32>>, TokenizerError> {
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        let encodings = self.inner.encode_batch(lines, false).map_err(|e| self.encode_error(e))?;
        Ok(encodings.iter().map(|e| e.get_ids().to_vec()).collect())
    }

    fn encode_error(&self, e: tokenizers::Error) -> TokenizerError {
        TokenizerError::Encode { path: self.path.clone(), message: e.to_string() }
    }
}

#[cfg(test)]
mod tests {
    use super::Tokenizer;

    /// A file that is not a tokenizer.json says what it is not (it gave a serde position only).
    #[test]
    fn a_file_that_is_no_tokenizer_says_so() {
        let dir = std::env::temp_dir().join(format!("tokenizer-not-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, text, said) in [
            ("config.json", r#"{"vocab_size": 3}"#, "JSON, but not a Hugging Face tokenizer.json"),
            ("vocab.txt", "[PAD]\n[UNK]\n", "not even JSON"),
        ] {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            let err = Tokenizer::from_file(&path).err().expect("refused").to_string();
            assert!(err.contains(said) && err.contains(name), "{err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
