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

/// A tokenizer read from a `tokenizer.json`. It encodes without the special tokens its
/// post-processor would add: the data code frames sequences itself (BERT's `[CLS] ... [SEP]`).
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: String,
}

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        let p = path.display().to_string();
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError::Read { path: p.clone(), message: e.to_string() })?;
        Ok(Tokenizer { inner, path: p })
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
