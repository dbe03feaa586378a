#!/usr/bin/env bash
# Everything this project checks on a CUDA machine, in one time-boxed go: the kernels' GPU tests and benchmarks, and
# real training runs of BandPO / DGPO against TRL's GRPOTrainer (plain and under DeepSpeed ZeRO-3). Steps run most
# important first; each is time-boxed, and no step starts once the budget RUN_GPU_BUDGET_S (default 540 s) is spent,
# so a device call with timeout_s=600 always returns the outputs.
#
#   bash benchmarks/gpu_wheels.sh                 # here, once: .whl/ with trl, datasets, math-verify, deepspeed
#   bash benchmarks/run_gpu.sh                    # there: writes to $OUT if set, else /tmp/trl_bandpo_gpu_out/
#   RUN_GPU_STEPS=train_wide,zero3 bash benchmarks/run_gpu.sh     # only these steps (a rerun of what was skipped)
#   RUN_GPU_REHEARSAL=1 bash benchmarks/run_gpu.sh                # on a CPU machine: every step, CPU-sized
#
# Settings are checked before anything runs, and a bad one exits 2 naming it: RUN_GPU_STEPS (step names below,
# comma-separated), RUN_GPU_BUDGET_S (whole seconds), RUN_GPU_REHEARSAL (1, or 0 / unset), PYTHON (default python3),
# OUT (a folder this script can write; an output that cannot be written later fails the run too).
#
# $OUT holds two files, rewritten after every step (a device call returns at most 8): summary.md, every step's
# output one after the other, and results.tar.gz, the same outputs as the files named below. The working folder the
# steps write to (mktemp -d, under $TMPDIR) is removed on every exit: the end of the run, a failure, or SIGINT /
# SIGTERM / SIGHUP (which also stop the step that is running).
#
# A machine without trl gets it from .whl/ (installed with --no-deps into /tmp/site, put first on PYTHONPATH).
# Steps and outputs (in results.tar.gz):
#   env            env.txt: device, driver, versions; trl_bandpo's kernels import without trl
#   gpu_tests      pytest_gpu.txt: tests marked gpu in test_kernels / test_band_radius (compiled kernels vs mpmath
#                  and the torch solver per dtype, the kernel's self-check, per-token radius without host sync,
#                  torch.compile, CUDA graphs, > 2^31 elements)
#   bench_kl       bench_cuda_float32.md: KL bounds, Triton vs torch solver vs authors'-style bisection vs a copy,
#                  with the launch-configuration sweep
#   train_tiny     bench_train_tiny.md/.json: GRPOTrainer vs BandPOTrainer (clip, band) vs DGPOTrainer, bf16
#   train_wide     bench_train_wide.md/.json: the same on a hidden-1024, 16-layer model built locally
#   zero3          bench_train_zero3.md/.json: GRPO vs BandPO under accelerate + DeepSpeed ZeRO-3 (1 process)
#   entropies      bench_old_entropies.txt: cost of asking the old-log-prob pass for entropies (adaptive radius)
#   bench_bf16     bench_cuda_bfloat16.md: KL bounds from bfloat16 log-probs
#   interpreter    pytest_interpreter.txt: the kernel tests' interpreter half (TRITON_INTERPRET) with this Triton
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS=(gpu_tests bench_kl train_tiny train_wide zero3 entropies bench_bf16 interpreter)  # the run_step names below

fail() {
  echo "run_gpu.sh: error: $*" >&2
  exit 2
}
BUDGET_S="${RUN_GPU_BUDGET_S:-540}"
[[ "$BUDGET_S" =~ ^[0-9]+$ ]] || fail "RUN_GPU_BUDGET_S='$BUDGET_S' is not a whole number of seconds"
case "${RUN_GPU_REHEARSAL:-}" in
  "" | 0) REHEARSAL="" ;;
  1) REHEARSAL=1 ;;
  *) fail "RUN_GPU_REHEARSAL='$RUN_GPU_REHEARSAL' is not 1 (CPU-sized steps) or 0 / unset (the GPU run)" ;;
esac
ALLOWED="$(IFS=,; echo "${STEPS[*]}")"
if [[ -n "${RUN_GPU_STEPS:-}" ]]; then
  IFS=, read -r -a wanted <<<"$RUN_GPU_STEPS"
  for step in "${wanted[@]}"; do
    if [[ -n "$step" && ",$ALLOWED," != *",$step,"* ]]; then
      fail "RUN_GPU_STEPS='$RUN_GPU_STEPS' names an unknown step '$step'; the steps are $ALLOWED"
    fi
  done
fi
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || fail "PYTHON='$PY' is not a command"
OUT="${OUT:-${TMPDIR:-/tmp}/trl_bandpo_gpu_out}"
{ mkdir -p "$OUT" && : >"$OUT/summary.md"; } 2>/dev/null || fail "cannot write to the output folder OUT='$OUT'"
WORK="$(mktemp -d)" || fail "cannot create a working folder (mktemp -d)"
STEP_PID=""  # the running step's `timeout`, stopped on the way out
cleanup() {
  [[ -n "$STEP_PID" ]] && kill "$STEP_PID" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
status=0
DEVICE=cuda
[[ -n "$REHEARSAL" ]] && DEVICE=cpu

# collect NAME FILE: append FILE to summary.md under a heading, and repack results.tar.gz (failing the run if $OUT
# cannot take them).
collect() {
  {
    printf '\n## %s (%s)\n\n```\n' "$1" "$(basename "$2")" >>"$OUT/summary.md" \
      && cat "$2" >>"$OUT/summary.md" \
      && printf '```\n' >>"$OUT/summary.md" \
      && tar -czf "$OUT/results.tar.gz" -C "$WORK" .
  } || {
    echo "run_gpu.sh: cannot write the outputs of $1 to OUT='$OUT'" >&2
    status=1
  }
}

# run_step NAME LIMIT_S OUTFILE CMD...: CMD time-boxed to min(LIMIT_S, what is left of BUDGET_S), output in
# $WORK/OUTFILE; skipped when RUN_GPU_STEPS does not name it, or (marking the run failed) when < 15 s are left.
run_step() {
  local name=$1 limit=$2 out="$WORK/$3"
  shift 3
  if [[ -n "${RUN_GPU_STEPS:-}" && ",$RUN_GPU_STEPS," != *",$name,"* ]]; then
    return
  fi
  local left=$((BUDGET_S - SECONDS))
  ((left < limit)) && limit=$left
  if ((limit < 15)); then
    echo "run_gpu.sh: step $name skipped, time budget spent" | tee "$out"
    status=1
    collect "$name" "$out"
    return
  fi
  echo "run_gpu.sh: step $name (limit ${limit}s, at ${SECONDS}s)"
  # in the background, waited for: a signal to this script is handled at once (the trap stops the step), not after it
  timeout "$limit" "$@" >"$out" 2>&1 </dev/null &
  STEP_PID=$!
  wait "$STEP_PID"
  local rc=$?
  STEP_PID=""
  tail -n 25 "$out"
  if ((rc != 0)); then
    echo "run_gpu.sh: step $name FAILED (exit $rc$( ((rc == 124)) && echo ', time limit'))" | tee -a "$out"
    status=1
  fi
  collect "$name" "$out"
}

if ! "$PY" -c "import trl" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH" || status=1
fi

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv || true
  "$PY" - <<'EOF'
import importlib, importlib.metadata, sys, torch
versions = ["python " + sys.version.split()[0], "torch " + torch.__version__, "cuda " + str(torch.version.cuda)]
for name in ("triton", "transformers", "accelerate", "peft", "trl", "datasets", "deepspeed", "math_verify"):
    try:  # imported, not only installed: a missing dependency shows here; the steps that need it fail on their own
        importlib.import_module(name)
        versions.append(f"{name} {importlib.metadata.version(name.replace('_', '-'))}")
    except Exception as err:
        versions.append(f"{name} unavailable ({type(err).__name__}: {err})")
print(" | ".join(versions), "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")
EOF
  "$PY" -c "import sys, trl_bandpo.core.band, trl_bandpo.kernels.band_kl; \
assert 'trl' not in sys.modules, 'the kernels imported trl'; print('trl_bandpo kernels import without trl: ok')"
} >"$WORK/env.txt" 2>&1 || status=1
cat "$WORK/env.txt"
collect env "$WORK/env.txt"

PYTEST=("$PY" -m pytest -p no:cacheprovider)
TRAIN=("$PY" benchmarks/bench_train_gpu.py --device "$DEVICE")
if [[ -n "$REHEARSAL" ]]; then  # CPU: the same steps, sized to finish
  TINY=(--sizes tiny --steps 8 --batch 16 --length 16 --rounds 1)
  WIDE=(--sizes tiny --steps 8 --batch 16 --length 32 --rounds 1)
  ZERO3=(--sizes tiny --steps 8 --batch 16 --length 16 --rounds 1)
  ZERO3_CONFIG=tests/scripts/zero3_cpu.yaml
  SIZES=(--sizes 65536 --repeats 3)
else
  TINY=(--sizes tiny --steps 16 --batch 32 --length 64 --rounds 2)
  WIDE=(--sizes wide --steps 12 --batch 128 --length 128 --rounds 2)
  ZERO3=(--sizes wide --steps 8 --batch 64 --length 64 --rounds 1)
  ZERO3_CONFIG=accelerate_configs/zero3.yaml
  SIZES=()
fi

run_step gpu_tests 220 pytest_gpu.txt "${PYTEST[@]}" tests/test_kernels.py tests/test_band_radius.py -m gpu -v -rA
run_step bench_kl 90 bench_cuda_float32.md "$PY" benchmarks/bench_band.py --device "$DEVICE" --sweep "${SIZES[@]}"
run_step train_tiny 60 bench_train_tiny.log "${TRAIN[@]}" "${TINY[@]}" --out "$WORK/bench_train_tiny.md"
run_step train_wide 120 bench_train_wide.log "${TRAIN[@]}" "${WIDE[@]}" --out "$WORK/bench_train_wide.md"
run_step zero3 90 bench_train_zero3.log "$PY" -m accelerate.commands.launch --config_file "$ZERO3_CONFIG" \
  --num_processes 1 --main_process_port 29651 benchmarks/bench_train_gpu.py --device "$DEVICE" "${ZERO3[@]}" \
  --methods grpo,band --label zero3 --out "$WORK/bench_train_zero3.md"
run_step entropies 40 bench_old_entropies.txt "$PY" benchmarks/bench_old_entropies.py --device "$DEVICE" \
  $([[ -n "$REHEARSAL" ]] && echo --batch 2 --length 64 --repeats 3 || echo --hidden 1024 --layers 16 --batch 64 \
  --length 1024)
run_step bench_bf16 40 bench_cuda_bfloat16.md "$PY" benchmarks/bench_band.py --device "$DEVICE" --dtype bfloat16 \
  --sizes "$([[ -n "$REHEARSAL" ]] && echo 65536 || echo 1048576,8388608)"
run_step interpreter 60 pytest_interpreter.txt "${PYTEST[@]}" tests/test_kernels.py -m "not gpu" -q -rfE -x

echo "run_gpu.sh: exit status $status after ${SECONDS}s" | tee -a "$WORK/env.txt"
collect done "$WORK/env.txt"
echo "outputs: $OUT/summary.md, $OUT/results.tar.gz"
exit $status
