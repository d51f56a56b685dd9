//! How the matrix runs: every configuration in a fresh process of this binary ([`child`]), the
//! models x policies and depth matrices with their timing rounds ([`matrix`]), PyTorch beside
//! them ([`baseline`]), the article's table projected at full size ([`projection`]), and GPT-2
//! against 24 GiB ([`gpt2_24gb`]).

pub mod baseline;
pub mod child;
pub mod gpt2_24gb;
pub mod kernels;
pub mod matrix;
pub mod projection;
