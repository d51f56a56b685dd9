#!/usr/bin/env bash
# What the vendored candle-core buys: the five `cpu` models under `off` and `sqrt`, step peak and
# step time, this repository's build (remat with `patched-candle` over vendor/candle-core) against
# the same commit built on candle-core as published (the workspace's [patch] removed, remat
# without `patched-candle`). Each configuration runs in a fresh process, the two builds one after
# the other and in turn first: round 1 measures, predicts and checks the gradients against plain
# candle; later rounds time the steps only. Writes OUT (default results/stock-candle-cpu): one
# JSON record per run in OUT/runs/, and TABLE.md.
#
#   scripts/stock-vs-patched.sh [OUT]     (ROUNDS=2, MODELS="resnet50 ...", PROFILE=cpu to choose)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/stock-candle-cpu}
rounds=${ROUNDS:-2}
profile=${PROFILE:-cpu}
models=${MODELS:-resnet50 resnet152 bert-large unet3d-small gpt2-small}
tree=target/stock-tree

cargo build --release -p bench-harness
git worktree remove --force "$tree" 2>/dev/null || rm -rf "$tree"
git worktree prune
git worktree add --detach "$tree" HEAD >/dev/null
# candle as published: no [patch] section, remat without the feature that needs the patches.
sed -i '/^\[patch.crates-io\]/,/^$/d; s/features = \["patched-candle", "meter"\]/features = ["meter"]/' "$tree/Cargo.toml"
! grep -q 'patched-candle\|patch.crates-io' "$tree/Cargo.toml"
(cd "$tree" && CARGO_TARGET_DIR="$PWD/../stock-target" cargo build --release -p bench-harness)

declare -A bin=([patched]=target/release/bench-harness [stock]=target/stock-target/release/bench-harness)
mkdir -p "$out/runs"
for r in $(seq 1 "$rounds"); do
  order="patched stock"
  ((r % 2 == 0)) && order="stock patched"
  flags=""
  ((r > 1)) && flags="--time-only"
  for m in $models; do
    for p in off sqrt; do
      for b in $order; do
        echo "round $r: $m $p on $b" >&2
        "${bin[$b]}" run-one --model "$m" --policy "$p" --profile "$profile" $flags > "$out/runs/$b-$m-$p-r$r.json"
      done
    done
  done
done
python3 scripts/stock_vs_patched_table.py "$out" "$(git rev-parse --short HEAD)" "$profile" > "$out/TABLE.md"
git worktree remove --force "$tree"
cat "$out/TABLE.md"
