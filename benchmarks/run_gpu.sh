#!/usr/bin/env bash
# Kernel tests and benchmarks on a CUDA machine, in one go (expected 3-5 minutes on an H200 with Triton compiles;
# at most ~10.5 minutes by the per-step time limits: give a device call timeout_s=600 and read $OUT).
# Needs torch, triton, pytest and mpmath; NOT trl (nothing imported here imports it) and no network.
#
#   bash benchmarks/run_gpu.sh            # from anywhere; writes to $OUT if set, else /tmp/trl_bandpo_gpu_out/
#
# Outputs: env.txt, pytest_gpu.txt (compiled kernel on CUDA: accuracy vs mpmath, vs the torch solver, specials,
# torch.compile, CUDA graphs, > 2^31 elements), pytest_interpreter.txt (the same checks under TRITON_INTERPRET on
# CPU, with this machine's Triton), bench_cuda_float32.md (+ launch-config sweep), bench_cuda_bfloat16.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-${TMPDIR:-/tmp}/trl_bandpo_gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
status=0

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv || true
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, \
'| cuda', torch.version.cuda, '| triton', triton.__version__, '|', torch.cuda.get_device_name())"
  "$PY" -c "import sys, trl_bandpo, trl_bandpo.band, trl_bandpo.kernels.band_kl; \
assert 'trl' not in sys.modules, 'trl_bandpo imported trl'; print('trl_bandpo imports without trl: ok')"
} 2>&1 | tee "$OUT/env.txt" || status=1

# Most important first; each step is time-boxed so the whole script stays within a 10-minute device call.
# Compiled kernel on the GPU (the `cuda` half of every comparison, plus the GPU-only tests).
timeout 240 "$PY" -m pytest tests/test_kernels.py -m gpu -v -rA -p no:cacheprovider 2>&1 \
  | tee "$OUT/pytest_gpu.txt" || status=1
timeout 180 "$PY" benchmarks/bench_band.py --device cuda --sweep 2>&1 | tee "$OUT/bench_cuda_float32.md" || status=1
# The interpreter half on CPU (checks this machine's Triton version interprets the kernel too).
timeout 120 "$PY" -m pytest tests/test_kernels.py -m "not gpu" -q -rfE -p no:cacheprovider 2>&1 \
  | tee "$OUT/pytest_interpreter.txt" || status=1
timeout 90 "$PY" benchmarks/bench_band.py --device cuda --dtype bfloat16 --sizes 1048576,8388608 2>&1 \
  | tee "$OUT/bench_cuda_bfloat16.md" || status=1

echo "run_gpu.sh: exit status $status (outputs in $OUT)"
exit $status
