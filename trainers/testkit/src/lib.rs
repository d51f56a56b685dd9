//! `testkit`: what the tests of the trainers and the harness share, and nothing the product
//! needs, one topic a module: the checkpointing checks every model runs ([`checkpointing`]), the
//! PyTorch reference fixtures ([`reference`]), memory checks of a training step ([`memory`]),
//! what training features must keep exact ([`training`]), running a trainer binary and reading
//! its log ([`cli`]), and the documentation's command lines still parsing ([`docs`]). A
//! dev-dependency only.

pub mod checkpointing;
pub mod cli;
pub mod docs;
pub mod memory;
pub mod reference;
pub mod training;

pub use cli::*;
pub use docs::*;
pub use memory::*;
pub use training::*;
