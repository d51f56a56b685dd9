#!/usr/bin/env bash
# What the vendored candle-core buys, patch by patch: the five `cpu` models under `off` and
# `sqrt`, step peak and step time, on five builds of one commit:
#   release  candle-core 0.11.1 as published (the workspace's [patch] removed, remat without
#            `patched-candle`: every stage input a stage graph reads is a copy, `Var::from_tensor`);
#   units    the release build under POLICY+units=auto: each segment run backward in the units
#            of stages the planner predicts lowest (no copies inside a unit);
#   0001     the release + vendor/patches/0001 (remat as on the release);
#   0002     + 0002 (remat with `patched-candle`: stage inputs read through `Var::sharing`);
#   0003     + 0003;
#   patched  + 0004: this repository's build (vendor/candle-core).
# The patches apply in order (each to the release plus the ones before it), so the builds add one
# patch at a time and each column's change from the one before is that patch's. Each
# configuration runs in a fresh process, the builds one after the other, their order rotating
# from round to round: round 1 measures, predicts and checks the gradients against plain candle on
# every build, and runs PyTorch on the same segments (scripts/torch_baseline.py, PYTHON); later
# rounds time the release, units and patched builds' steps only. Writes OUT (default
# results/stock-candle-cpu): one JSON record per run in OUT/runs/, and TABLE.md.
#
#   scripts/stock-vs-patched.sh [OUT]   (ROUNDS=2, MODELS="resnet50 ...", PROFILE=cpu, PYTHON=python3)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/stock-candle-cpu}
rounds=${ROUNDS:-2}
profile=${PROFILE:-cpu}
python=${PYTHON:-python3}
models=${MODELS:-resnet50 resnet152 bert-large unet3d-small gpt2-small}
tree=target/stock-tree
bins=target/stock-target/bins
"$python" -c 'import torch, torchvision, transformers' ||
  { echo "PYTHON=$python lacks torch, torchvision or transformers (README: setup)" >&2; exit 1; }

# The variants are built from HEAD, the patched build from the working tree: one commit for all.
git diff --quiet HEAD -- . ':!results' || { echo "commit first: every build must be of HEAD" >&2; exit 1; }
cargo build --release -p bench-harness
git worktree remove --force "$tree" 2>/dev/null || rm -rf "$tree"
git worktree prune
git worktree add --detach "$tree" HEAD >/dev/null
trap 'git worktree remove --force "$tree" 2>/dev/null || true' EXIT
mkdir -p "$bins"
cp target/release/bench-harness "$bins/patched"
# The variants, built one after the other in one worktree (candle's dependencies are built once).
patches=(vendor/patches/0001-*.patch vendor/patches/0002-*.patch vendor/patches/0003-*.patch vendor/patches/0004-*.patch)
cargo fetch -q --manifest-path crates/remat/Cargo.toml
release=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/candle-core-0.11.1 | head -1)
cp "$tree/Cargo.toml" "$bins/Cargo.toml.head"
for build in release 0001 0002 0003; do
  cp "$bins/Cargo.toml.head" "$tree/Cargo.toml"
  case $build in
    release) applied=0 ;;
    *) applied=$((10#$build)) ;;
  esac
  # As vendor/check.sh makes vendor/candle-core: the release from cargo's registry, patched (here
  # with the first `applied` patches), with the vendored copy's manifest (no example, test or
  # bench targets).
  rm -rf "$tree/vendor/candle-core" && cp -r "$release" "$tree/vendor/candle-core"
  chmod -R u+w "$tree/vendor/candle-core"
  for p in "${patches[@]:0:applied}"; do
    patch -s -p1 -d "$tree/vendor/candle-core" < "$p"
  done
  cp vendor/candle-core/Cargo.toml "$tree/vendor/candle-core/Cargo.toml"
  if [ "$build" = release ]; then
    sed -i '/^\[patch.crates-io\]/,/^$/d' "$tree/Cargo.toml"
    ! grep -q 'patch.crates-io' "$tree/Cargo.toml"
  fi
  if ((applied < 2)); then # Var::sharing comes with 0002
    sed -i 's/features = \["patched-candle", "meter"\]/features = ["meter"]/' "$tree/Cargo.toml"
    ! grep -q 'patched-candle' "$tree/Cargo.toml"
  fi
  echo "building $build (patches applied: $applied)" >&2
  (cd "$tree" && CARGO_TARGET_DIR="$PWD/../stock-target" cargo build --release -p bench-harness)
  cp target/stock-target/release/bench-harness "$bins/$build"
done

# PyTorch on the segments our policy chose, as `--baseline pytorch` runs it.
torch_run() {
  "$python" - "$1" "$python" <<'PY'
import json, subprocess, sys
r = json.load(open(sys.argv[1]))
size = r["input"].split()[-1].split("x")[0].split("^")[0]
segs = ",".join(f"{a}:{b}" for a, b in r["segment_ranges"])
cmd = [sys.argv[2], "scripts/torch_baseline.py", "--model", r["model"], "--policy", r["policy"],
       "--batch", str(r["batch"]), "--input-size", size, "--segments", segs, "--threads", str(r["threads"])]
print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
PY
}

all=(release units 0001 0002 0003 patched)
mkdir -p "$out/runs"
for r in $(seq 1 "$rounds"); do
  if ((r == 1)); then builds=("${all[@]}") flags=""; else builds=(release units patched) flags="--time-only"; fi
  # Rotate the order: every build runs first in some round.
  shift_by=$(((r - 1) % ${#builds[@]}))
  order=("${builds[@]:shift_by}" "${builds[@]:0:shift_by}")
  for m in $models; do
    for p in off sqrt; do
      for b in "${order[@]}"; do
        echo "round $r: $m $p on $b" >&2
        if [ "$b" = units ]; then bin=$bins/release policy=$p+units=auto; else bin=$bins/$b policy=$p; fi
        "$bin" run-one --model "$m" --policy "$policy" --profile "$profile" $flags > "$out/runs/$b-$m-$p-r$r.json"
      done
      if ((r == 1)); then
        echo "round $r: $m $p on pytorch" >&2
        torch_run "$out/runs/patched-$m-$p-r1.json" > "$out/runs/pytorch-$m-$p-r1.json"
      fi
    done
  done
done
"$python" scripts/stock_vs_patched_table.py "$out" "$(git rev-parse --short HEAD)" "$profile" > "$out/TABLE.md"
cat "$out/TABLE.md"
