#!/usr/bin/env bash
# On the GPU machine: a self-test, then the article's configurations in priority order, PyTorch
# beside ours on the same GPU, results into OUTDIR and bundled into OUTDIR/results.tar.gz.
#
#   scripts/gpu-matrix.sh OUTDIR [BINARY.gz]      (default binary: gpu-ship/bench-harness.gz)
#
# Prepare on a CPU machine (the binary is ignored by git, shipped with the device tool's `carry`):
#   scripts/build-cuda.sh --release -p bench-harness --features cuda
#   mkdir -p gpu-ship && strip -o gpu-ship/bench-harness target/release/bench-harness && gzip -f gpu-ship/bench-harness
# Budget: the self-test takes seconds; each stage below is cut off after its own seconds (the
# environment variables, defaults summing to 9 minutes) and whatever finished is kept (the harness
# saves after every configuration, and a later stage resumes the same folder):
#   FIRST_SECONDS   ResNet-50 batch 256 and BERT-Large 32 x 128 under off, sqrt and budget=24GiB
#   GPT2_SECONDS    GPT-2 XL at sequence 1024 under a 24 GiB cap, in the ways found to fit
#   LLM_SECONDS     Llama-family fine-tunes under a 24 GiB cap (--matrix llm-24gb): LoRA of the 3B,
#                   7B and 8B models and full bf16-weights fine-tuning of the 1B at seq 2048, under
#                   sqrt and the planner's budget=24GiB, each predicted first, run where it fits
#   SECOND_SECONDS  the 3D U-Net and ResNet-152
#   REST_SECONDS    every other policy and the depth sweep
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

# One harness call on the GPU, cut off after $2 seconds; its log in $OUT/$1.stderr.
stage() {
  local name=$1 seconds=$2; shift 2
  echo "== $name"
  timeout "$seconds" "$BIN" --device cuda "$@" 2>> "$OUT/$name.stderr"
  echo "$name exit: $? (124: cut off by its time budget; what finished is kept)"
  tail -5 "$OUT/$name.stderr"
}
FULL=(--profile full --matrix models --steps 3 --baseline pytorch --python python3 --out "$OUT/full-h200")
stage first "${FIRST_SECONDS:-180}" "${FULL[@]}" --models resnet50,bert-large --policies off,sqrt,budget=24GiB
stage gpt2-xl "${GPT2_SECONDS:-120}" --matrix gpt2-24gb --memory-cap 24GiB --steps 1 --rounds 0 --out "$OUT/gpt2-xl-h200" \
  --models gpt2-xl/bf16-weights-adamw,gpt2-xl/f32-adamw-in-backward,gpt2-xl/bf16-adafactor --policies sqrt,every-two-blocks
LLM=llama-3.2-3b/2048/lora-r16,llama-3.1-8b/2048/lora-r16,qwen2.5-7b/2048/lora-r16,llama-3.2-1b/2048/bf16-weights-adamw
stage llm "${LLM_SECONDS:-120}" --matrix llm-24gb --memory-cap 24GiB --steps 1 --rounds 0 --out "$OUT/llm-24gb-h200" \
  --models "$LLM" --policies sqrt,budget=24GiB
stage second "${SECOND_SECONDS:-60}" "${FULL[@]}" --models unet3d-cicek,resnet152
stage rest "${REST_SECONDS:-60}" --profile full --matrix all --steps 3 --baseline pytorch --python python3 --out "$OUT/full-h200"
"$BIN" --matrix render --out "$OUT/full-h200" 2>> "$OUT/rest.stderr"
"$BIN" --matrix render --out "$OUT/gpt2-xl-h200" 2>> "$OUT/rest.stderr"
"$BIN" --matrix render --out "$OUT/llm-24gb-h200" 2>> "$OUT/rest.stderr"
tar czf "$OUT/results.tar.gz" -C "$OUT" --exclude results.tar.gz .
echo "bundled: $OUT/results.tar.gz"
