#!/usr/bin/env bash
# Kernel tests and benchmarks on a CUDA machine, in one go (expected 3-5 minutes on an H200 with Triton compiles;
# each step is time-boxed and the whole script stops starting steps after RUN_GPU_BUDGET_S = 530 s, so it ends
# within ~9 minutes: give a device call timeout_s=600 and read $OUT).
# Needs torch, triton, pytest and mpmath; NOT trl (nothing imported here imports it) and no network.
#
#   bash benchmarks/run_gpu.sh            # from anywhere; writes to $OUT if set, else /tmp/trl_bandpo_gpu_out/
#
# Outputs: env.txt, pytest_gpu.txt (compiled kernel on CUDA: accuracy vs mpmath, vs the torch solver, specials,
# torch.compile, CUDA graphs, > 2^31 elements), pytest_interpreter.txt (the same checks under TRITON_INTERPRET on
# CPU, with this machine's Triton), bench_cuda_float32.md (+ launch-config sweep), bench_cuda_bfloat16.md,
# pytest_surrogate_gpu.txt (the fused Band-clipped surrogate kernel on CUDA: loss and gradient vs the torch path,
# torch.compile, CUDA graphs), bench_cuda_surrogate.md (fused surrogate forward + backward vs the torch paths vs
# TRL's plain clip loss at 1M tokens). The interpreter step also runs tests/test_band_surrogate.py on CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-${TMPDIR:-/tmp}/trl_bandpo_gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
status=0
BUDGET_S="${RUN_GPU_BUDGET_S:-530}"

# run_step LIMIT_S OUTFILE CMD...: CMD time-boxed to min(LIMIT_S, what is left of BUDGET_S), output teed to
# $OUT/OUTFILE; skipped (and the run marked failed) when less than 10 s are left.
run_step() {
  local limit=$1 out="$OUT/$2"
  shift 2
  local left=$((BUDGET_S - SECONDS))
  ((left < limit)) && limit=$left
  if ((limit < 10)); then
    echo "run_gpu.sh: skipped, time budget spent: $*" | tee "$out"
    status=1
    return
  fi
  timeout "$limit" "$@" 2>&1 | tee "$out" || status=1
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv || true
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, \
'| cuda', torch.version.cuda, '| triton', triton.__version__, '|', torch.cuda.get_device_name())"
  "$PY" -c "import sys, trl_bandpo, trl_bandpo.band, trl_bandpo.kernels.band_kl, trl_bandpo.kernels.band_surrogate; \
assert 'trl' not in sys.modules, 'trl_bandpo imported trl'; print('trl_bandpo imports without trl: ok')"
} 2>&1 | tee "$OUT/env.txt" || status=1

# Most important first; each step is time-boxed so the whole script stays within a 10-minute device call.
# Compiled kernel on the GPU (the `cuda` half of every comparison, plus the GPU-only tests).
run_step 200 pytest_gpu.txt "$PY" -m pytest tests/test_kernels.py -m gpu -v -rA -p no:cacheprovider
run_step 150 bench_cuda_float32.md "$PY" benchmarks/bench_band.py --device cuda --sweep
# The fused Band-clipped surrogate: compiled kernel vs the torch path, then forward + backward timings at 1M tokens
# with the authors' settings (upper_max = 10, dual clip 10).
run_step 100 pytest_surrogate_gpu.txt "$PY" -m pytest tests/test_band_surrogate.py -m gpu -v -rA -p no:cacheprovider
run_step 60 bench_cuda_surrogate.md "$PY" benchmarks/bench_band.py --device cuda --surrogate-only --upper-max 10 \
  --delta 10
# The interpreter half on CPU (checks this machine's Triton version interprets the kernels too).
run_step 100 pytest_interpreter.txt "$PY" -m pytest tests/test_kernels.py tests/test_band_surrogate.py \
  -m "not gpu" -q -rfE -p no:cacheprovider
run_step 60 bench_cuda_bfloat16.md "$PY" benchmarks/bench_band.py --device cuda --dtype bfloat16 \
  --sizes 1048576,8388608

echo "run_gpu.sh: exit status $status after ${SECONDS}s (outputs in $OUT)"
exit $status
