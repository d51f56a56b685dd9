//! The data of a causal language model (GPT-2, the Llama family), as its flags choose it: token
//! sequences of `--seq` from the built-in corpus, a token file, or a text file through its
//! tokenizer. Not here: a masked LM's data (BERT's own), the models.

use crate::hub::HubFiles;
use crate::inputs::{Input, Reads};
use anyhow::{bail, Context, Result};
use datasets::tokens::Batcher;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// The data flags of a causal language model. The run's configuration keeps the sequence length
/// and the data sources; the tokenizer follows from them.
#[derive(clap::Args, Debug, Serialize)]
pub struct TokenArgs {
    /// Sequence length (at most the model's context).
    #[arg(long, default_value_t = 256)]
    pub seq: usize,
    /// Flat u16 little-endian token file; default: the built-in synthetic corpus (byte tokens).
    #[arg(long, conflicts_with = "text")]
    #[serde(serialize_with = "crate::data_source")]
    pub data: Option<PathBuf>,
    /// A UTF-8 text file to train on, tokenized whole and packed into full sequences.
    #[arg(long)]
    #[serde(serialize_with = "crate::data_source")]
    pub text: Option<PathBuf>,
    /// The tokenizer.json for --text; default: the --model-id's, or one beside --config or --init.
    /// (clap checks `requires` only where no conflicting flag is given: `--data` names itself.)
    #[arg(long, requires = "text", conflicts_with = "data")]
    #[serde(skip)]
    pub tokenizer: Option<PathBuf>,
}

impl TokenArgs {
    /// The files these flags read, with their flags: `--data` or `--text` and its tokenizer
    /// (where it comes from as in [`TokenArgs::batcher`]).
    pub fn files(&self, hub: Option<&HubFiles>, beside: &[Option<&Path>]) -> Vec<Input> {
        let mut files = crate::inputs::given(&[("--data", &self.data), ("--text", &self.text)]);
        if self.text.is_some() {
            let tokenizer = crate::hub::tokenizer_file(self.tokenizer.as_deref(), hub, beside);
            files.extend(tokenizer.map(|p| Input::file("--text's tokenizer", &p, Reads::Setup)));
        }
        files
    }

    /// Refuses a `--seq` the model's `context` (its positions) cannot take.
    pub fn check_context(&self, context: usize) -> Result<()> {
        if self.seq == 0 || self.seq > context {
            bail!(
                "--seq {} is out of range: the model's context is 1..={context} positions",
                self.seq
            );
        }
        Ok(())
    }

    /// The batches of a model of `vocab_size` tokens: `--data`'s tokens, `--text` through its
    /// tokenizer (`--tokenizer`, the hub model's, or one beside any of `beside`), or the built-in
    /// corpus as bytes.
    pub fn batcher(
        &self,
        vocab_size: usize,
        seed: u64,
        hub: Option<&HubFiles>,
        beside: &[Option<&Path>],
    ) -> Result<Batcher> {
        let tokens = match (&self.data, &self.text) {
            (Some(path), _) => datasets::tokens::load_u16(path)?,
            (None, Some(path)) => self.text_tokens(path, hub, beside)?,
            (None, None) => {
                datasets::text::byte_tokens(&datasets::text::synthetic_corpus(seed, 1 << 20))
            }
        };
        Batcher::new(tokens, self.seq, vocab_size, seed).context(if self.text.is_some() {
            "--text"
        } else {
            "--data"
        })
    }

    /// `--text` through its tokenizer, as one token stream.
    fn text_tokens(
        &self,
        path: &Path,
        hub: Option<&HubFiles>,
        beside: &[Option<&Path>],
    ) -> Result<Vec<u32>> {
        let text = crate::read_text("--text", path)?;
        let Some(file) = crate::hub::tokenizer_file(self.tokenizer.as_deref(), hub, beside) else {
            bail!(
                "--text needs a tokenizer: give --tokenizer tokenizer.json (or put one beside \
                 --config or --init)"
            );
        };
        let ids = datasets::tokenizer::Tokenizer::from_file(&file)?.encode(&text)?;
        crate::say!("--text {}: {} tokens by {}", path.display(), ids.len(), file.display());
        Ok(ids)
    }
}
