#!/usr/bin/env bash
# Wheels for a CUDA machine that has torch, triton, transformers, accelerate and peft but no trl (and cannot reach a
# package index): trl and datasets with the dependencies such an image lacks, math-verify, and DeepSpeed (built here
# as a pure-Python wheel, its CUDA ops compiled on first use). Versions are those of this machine's environment, so
# the GPU run tests what the CPU tests passed on. benchmarks/run_gpu.sh installs them from .whl/ when trl is missing.
#
#   bash benchmarks/gpu_wheels.sh [DEST (default .whl)]        # PYTHON=... picks the environment to copy versions from
#   PYTHON_VERSION=3.12 selects the target machine's Python (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.whl}"
PY="${PYTHON:-.venv/bin/python}"
TARGET_PY="${PYTHON_VERSION:-3.12}"
mkdir -p "$DEST"
version() { "$PY" -m pip show "$1" 2>/dev/null | awk '/^Version:/{print $2}'; }
pins=()
for name in trl datasets dill multiprocess math-verify latex2sympy2_extended antlr4-python3-runtime hjson pydantic \
  pydantic-core annotated-types typing-inspection; do
  v=$(version "$name")
  [[ -n "$v" ]] || { echo "gpu_wheels.sh: $name is not installed in $PY" >&2; exit 1; }
  pins+=("$name==$v")
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PY" --implementation cp \
  "${platforms[@]}" -d "$DEST" "${pins[@]}"
# DeepSpeed publishes only a source archive: build a pure-Python wheel (no ops pre-built).
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "deepspeed==$(version deepspeed)"
ls -1 "$DEST"
