//! The data of a causal language model (GPT-2, the Llama family), as its flags choose it: token
//! sequences of `--seq` from the built-in corpus, a token file, or a text file through its
//! tokenizer, packed into full sequences or one example per line, padded ([`Packing`]). Not here:
//! a masked LM's data (BERT's own), the models.

use crate::hub::HubFiles;
use crate::inputs::{Input, Reads};
use anyhow::{bail, Context, Result};
use datasets::tokens::{Batcher, Padded};
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
    /// A UTF-8 text file to train on, through its tokenizer, as --packing says.
    #[arg(long)]
    #[serde(serialize_with = "crate::data_source")]
    pub text: Option<PathBuf>,
    /// How --text becomes sequences: `stream` (tokenized whole, cut into full sequences of
    /// --seq) or `lines` (each non-empty line one example, right-padded to --seq, the padding
    /// skipped by the loss; a longer line is cut into pieces).
    #[arg(long, value_enum, default_value_t = Packing::Stream, requires = "text")]
    pub packing: Packing,
    /// The tokenizer.json for --text; default: the --model-id's, or one beside --config or --init.
    /// (clap checks `requires` only where no conflicting flag is given: `--data` names itself.)
    #[arg(long, requires = "text", conflicts_with = "data")]
    #[serde(skip)]
    pub tokenizer: Option<PathBuf>,
}

/// How a text becomes a causal LM's sequences.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Packing {
    /// Tokenized whole, cut into full sequences: no padding.
    Stream,
    /// One example per line, right-padded; the loss skips the padding (`ops::fused::IGNORE`).
    Lines,
}

/// A causal LM's batches: windows of one token stream, or padded examples.
#[derive(Debug)]
pub enum TokenData {
    Stream(Batcher),
    Lines(Padded),
}

impl TokenData {
    /// The batch of `step`: (inputs, targets), `batch` sequences flattened row-major; a padded
    /// target is `ops::fused::IGNORE`.
    pub fn batch(&self, step: u64, batch: usize) -> (Vec<u32>, Vec<u32>) {
        match self {
            TokenData::Stream(b) => b.batch(step, batch),
            TokenData::Lines(p) => p.batch(step, batch),
        }
    }

    /// How many distinct sequences it holds: windows of the stream, or examples.
    pub fn samples(&self) -> usize {
        match self {
            TokenData::Stream(b) => b.windows(),
            TokenData::Lines(p) => p.len(),
        }
    }
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
    /// tokenizer (`--tokenizer`, the hub model's, or one beside any of `beside`) packed as
    /// `--packing` says, or the built-in corpus as bytes.
    pub fn batcher(
        &self,
        vocab_size: usize,
        seed: u64,
        hub: Option<&HubFiles>,
        beside: &[Option<&Path>],
    ) -> Result<TokenData> {
        if let (Some(path), Packing::Lines) = (&self.text, self.packing) {
            return Ok(TokenData::Lines(self.lines(path, vocab_size, seed, hub, beside)?));
        }
        let tokens = match (&self.data, &self.text) {
            (Some(path), _) => datasets::tokens::load_u16(path)?,
            (None, Some(path)) => self.text_tokens(path, hub, beside)?,
            (None, None) => {
                datasets::text::byte_tokens(&datasets::text::synthetic_corpus(seed, 1 << 20))
            }
        };
        let what = if self.text.is_some() { "--text" } else { "--data" };
        Ok(TokenData::Stream(Batcher::new(tokens, self.seq, vocab_size, seed).context(what)?))
    }

    /// `--text` through its tokenizer, as one token stream.
    fn text_tokens(
        &self,
        path: &Path,
        hub: Option<&HubFiles>,
        beside: &[Option<&Path>],
    ) -> Result<Vec<u32>> {
        let text = crate::read_text("--text", path)?;
        let (tokenizer, by) = self.tokenizer(hub, beside)?;
        let ids = tokenizer.encode(&text)?;
        crate::say!("--text {}: {} tokens by {}", path.display(), ids.len(), by.display());
        Ok(ids)
    }

    /// `--text` through its tokenizer, one padded example per line (`--packing lines`).
    fn lines(
        &self,
        path: &Path,
        vocab_size: usize,
        seed: u64,
        hub: Option<&HubFiles>,
        beside: &[Option<&Path>],
    ) -> Result<Padded> {
        let text = crate::read_text("--text", path)?;
        let (tokenizer, by) = self.tokenizer(hub, beside)?;
        let lines = tokenizer.encode_lines(&text)?;
        let tokens: usize = lines.iter().map(Vec::len).sum();
        let data =
            Padded::new(lines, self.seq, vocab_size, ops::fused::IGNORE, seed).context("--text")?;
        crate::say!(
            "--text {}: {tokens} tokens by {} in {} examples of at most {} tokens (--packing \
             lines)",
            path.display(),
            by.display(),
            data.len(),
            self.seq + 1
        );
        Ok(data)
    }

    /// `--text`'s tokenizer, read, and its file.
    fn tokenizer(
        &self,
        hub: Option<&HubFiles>,
        beside: &[Option<&Path>],
    ) -> Result<(datasets::tokenizer::Tokenizer, PathBuf)> {
        let Some(file) = crate::hub::tokenizer_file(self.tokenizer.as_deref(), hub, beside) else {
            bail!(
                "--text needs a tokenizer: give --tokenizer tokenizer.json (or put one beside \
                 --config or --init)"
            );
        };
        Ok((datasets::tokenizer::Tokenizer::from_file(&file)?, file))
    }
}
