//! How the matrix runs: every configuration in a fresh process of this binary ([`child`]), the
//! models x policies and depth matrices with their timing rounds ([`matrix`]), PyTorch beside
//! them ([`baseline`]), the article's table projected at full size ([`projection`]), GPT-2
//! against 24 GiB ([`fits_24gb`]), and the kernel bench's command ([`kernels`]). What they share:
//! whether configurations run or are only predicted ([`Execution`], `--dry-run`), and what becomes
//! of a result the folder holds ([`Existing`], `--force`).

pub mod baseline;
pub mod child;
pub mod fits_24gb;
pub mod kernels;
pub mod lock;
pub mod matrix;
pub mod projection;
pub mod rounds;

/// Whether a matrix measures its configurations or, `--dry-run`, only predicts them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Execution {
    /// Each configuration run and measured (`gpt2-24gb`: where it is predicted to fit).
    Measure,
    /// Each configuration predicted, none run.
    DryRun,
}

/// What a run does with a result the results folder holds already.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Existing {
    /// Keeps it: the run resumes.
    Keep,
    /// Makes it again (`--force`).
    Replace,
}
