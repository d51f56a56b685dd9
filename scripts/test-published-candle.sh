#!/usr/bin/env bash
# remat as a candle user gets it: built against candle as published (crates.io, no [patch]).
# Its own workspace's formatting, lints, tests, documentation and package, then the user's crate of
# examples/small-transformer (the guide's example): a model written with candle-nn, checkpointed,
# its gradients equal to plain candle's bit for bit and its measured peak lower.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="$PWD/target/published-candle" # one build of stock candle for both
for manifest in crates/remat/Cargo.toml examples/small-transformer/Cargo.toml; do
  cargo fmt --check --manifest-path "$manifest"
done
cargo clippy --manifest-path crates/remat/Cargo.toml --all-targets -- -D warnings
cargo clippy --manifest-path crates/remat/Cargo.toml --all-targets --features meter -- -D warnings
cargo clippy --manifest-path examples/small-transformer/Cargo.toml --all-targets -- -D warnings
cargo test --manifest-path crates/remat/Cargo.toml --features meter
RUSTDOCFLAGS="-D warnings" cargo doc --manifest-path crates/remat/Cargo.toml --no-deps --features meter
cargo package --manifest-path crates/remat/Cargo.toml --allow-dirty # what crates.io would take, built alone
cargo test --manifest-path examples/small-transformer/Cargo.toml
vendor/check.sh --test # vendor/candle-core = the release + vendor/patches, whose tests pass
