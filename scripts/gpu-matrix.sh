#!/usr/bin/env bash
# On the GPU machine: a self-test, then the `full` matrix, results into OUTDIR.
#
#   scripts/gpu-matrix.sh OUTDIR [BINARY.gz]      (default binary: gpu-ship/bench-harness.gz)
#
# Prepare on a CPU machine (the binary is ignored by git, shipped with the device tool's `carry`):
#   scripts/build-cuda.sh --release -p bench-harness --features cuda
#   mkdir -p gpu-ship && strip -o gpu-ship/bench-harness target/release/bench-harness && gzip -f gpu-ship/bench-harness
# Budget: the self-test takes seconds; the matrix is cut off after MATRIX_SECONDS (default 420)
# and whatever finished is kept (the harness saves after every configuration and resumes).
set -uo pipefail
OUT=${1:?usage: scripts/gpu-matrix.sh OUTDIR [BINARY.gz]}
BIN_GZ=${2:-gpu-ship/bench-harness.gz}
mkdir -p "$OUT"
BIN=/tmp/bench-harness
gzip -dc "$BIN_GZ" > "$BIN" && chmod +x "$BIN"

# The CUDA 13 libraries: the toolkit's and those of the nvidia-* wheels of an installed PyTorch.
LIBS=$( { echo /usr/local/cuda/lib64/; python3 -c 'import site;[print(p+"/nvidia/") for p in site.getsitepackages()]' 2>/dev/null; } |
  xargs -r -I{} find {} -maxdepth 3 \( -name libcublas.so.13 -o -name libcublasLt.so.13 -o -name libcurand.so.10 \
    -o -name libnvrtc.so.13 -o -name libcudnn.so.9 -o -name libnccl.so.2 \) -printf '%h\n' 2>/dev/null | awk '!s[$0]++' | paste -sd: || true)
export LD_LIBRARY_PATH=$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; ldd "$BIN" | grep 'not found'; } > "$OUT/environment.txt" 2>&1

echo "== self-test"
if ! timeout 120 "$BIN" selftest --device cuda > "$OUT/selftest.json" 2> "$OUT/selftest.stderr"; then
  echo "self-test failed:"; tail -20 "$OUT/selftest.stderr"; exit 1
fi
cat "$OUT/selftest.json"

echo "== full matrix"
timeout "${MATRIX_SECONDS:-420}" "$BIN" --matrix all --profile full --device cuda --steps 3 --out "$OUT/full-h200" 2> "$OUT/matrix.stderr"
echo "matrix exit: $? (124: cut off by the time budget; finished configurations are in $OUT/full-h200)"
"$BIN" --matrix render --profile full --device cuda --out "$OUT/full-h200" 2>> "$OUT/matrix.stderr"
tail -40 "$OUT/matrix.stderr"
