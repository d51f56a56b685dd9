#!/usr/bin/env bash
# Builds this workspace's `cuda` feature on a Linux x86-64 machine with no GPU and no CUDA install:
# the CUDA compiler, headers and runtime come from NVIDIA's CUDA packages on PyPI (downloaded into
# a virtual environment this script creates), and the driver-side libraries that candle links
# against (libcuda, cuBLAS, cuRAND, NVRTC) are replaced at link time by stubs that carry only their
# names; the real ones are found on the GPU machine when the binary starts.
#
# usage: scripts/build-cuda.sh [cargo build arguments]      (from the repository root)
#   e.g. scripts/build-cuda.sh --release -p bench-harness --features cuda
#        scripts/build-cuda.sh --check    (type-checks every crate and target with the cuda and
#                                          nccl features, in target/cuda-check; nothing is linked)
#
# environment:
#   CUDA_COMPUTE_CAP   the GPU's compute capability without the dot (default 90: H100/H200)
#   CUDA_BUILD_ROOT    where the toolkit, the stubs and the virtual environment are kept
#                      (default ~/.cache/remat-cuda-build); reused by later builds
#   PYTHON             the Python that creates the virtual environment (default python3)
#
# The toolkit is pinned to CUDA 13.0 (nvcc 13.0.88): PTX from newer compilers can be refused by a
# 13.0 driver. A first build takes 15-25 minutes on 2 cores, most of it candle's CUDA kernels;
# keep the target folder. After changing the toolkit: `cargo clean -p candle-kernels`.
# Then, on the GPU machine, `scripts/gpu-matrix.sh OUTDIR` runs the shipped binary.
set -euo pipefail

if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
[ -f Cargo.toml ] && grep -q '^\[workspace\]' Cargo.toml || { echo "run from the repository root" >&2; exit 2; }

ROOT=${CUDA_BUILD_ROOT:-$HOME/.cache/remat-cuda-build}
export CUDA_HOME=$ROOT/cuda
VENV=$ROOT/venv
mkdir -p "$ROOT"

# 1. The toolkit: nvcc, its front end and NVVM, the runtime and the C++ headers, from PyPI.
if [ ! -x "$CUDA_HOME/bin/nvcc" ]; then
  [ -x "$VENV/bin/pip" ] || "${PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/pip" download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64 \
    -d "$ROOT/wheels" \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
  rm -rf "$ROOT/unpacked" "$CUDA_HOME"
  # Each wheel holds its part of the toolkit under nvidia/cu13/: merge them into one CUDA_HOME.
  "$VENV/bin/python" - "$ROOT/wheels" "$ROOT/unpacked" <<'EOF'
import os, sys, zipfile, glob
wheels, dest = sys.argv[1], sys.argv[2]
for wheel in glob.glob(os.path.join(wheels, "*.whl")):
    with zipfile.ZipFile(wheel) as z:
        for entry in z.infolist():
            if entry.filename.startswith("nvidia/cu13/"):
                path = z.extract(entry, dest)
                if (entry.external_attr >> 16) & 0o111:
                    os.chmod(path, 0o755)
EOF
  mv "$ROOT/unpacked/nvidia/cu13" "$CUDA_HOME"
  rm -rf "$ROOT/unpacked"
  ln -s lib "$CUDA_HOME/lib64"
  # candle's kernels link `-lcudart`: point it at the static runtime, so the binary needs no
  # libcudart at run time.
  echo "INPUT($CUDA_HOME/lib/libcudart_static.a -lrt -ldl -lpthread)" > "$CUDA_HOME/lib/libcudart.so"
fi

# 2. Link stubs: one shared library per driver-side dependency, exporting every function the Rust
#    bindings (cudarc) declare, each a dummy. Only their names (SONAME) end up in the binary.
cargo fetch -q
locked_version() { awk -v n="$1" '$0 == "name = \"" n "\"" { getline; gsub(/[^0-9.]/, ""); print; exit }' Cargo.lock; }
CUDARC=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"cudarc-$(locked_version cudarc)" | head -1)
mkdir -p "$CUDA_HOME/lib/stubs"
while read -r module lib soname; do
  [ -f "$CUDA_HOME/lib/stubs/$lib.so" ] && continue
  grep -oE '^pub unsafe fn [A-Za-z_][A-Za-z0-9_]*' "$CUDARC/src/$module/sys/mod.rs" | awk '{ print $4 }' | sort -u |
    awk '{ printf "int %s(void) { return 999; }\n", $1 }' > "$ROOT/$lib.c"
  cc -shared -fPIC -o "$CUDA_HOME/lib/stubs/$lib.so" -Wl,-soname,"$soname" "$ROOT/$lib.c"
done <<'EOF'
driver libcuda libcuda.so.1
cublas libcublas libcublas.so.13
cublaslt libcublasLt libcublasLt.so.13
curand libcurand libcurand.so.10
nvrtc libnvrtc libnvrtc.so.13
nccl libnccl libnccl.so.2
EOF

# 3. Build. cudarc reads the CUDA version from `nvcc --version`; candle's kernels compile for
#    CUDA_COMPUTE_CAP.
export PATH=$CUDA_HOME/bin:$PATH
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export LIBRARY_PATH=$CUDA_HOME/lib/stubs:$CUDA_HOME/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2} CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-2}
if [ "${1:-}" = "--check" ]; then
  features="bench-harness/cuda"
  for crate in trainkit gpt2 bert resnet unet3d; do features="$features $crate/nccl"; done
  CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda-check} exec cargo check --workspace --all-targets --features "$features"
fi
cargo build "$@"
