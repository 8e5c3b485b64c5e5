#!/usr/bin/env bash
# The one device check, on one GPU, inside a total time bound (default 530 s, under 9 minutes):
#   1. the kernels' bit-identity tests (tests/gpu without the end-to-end file),
#   2. the kernel bench at 25M and 100M elements (bytes per element, roofline, %copy, targets),
#   3. the GPU end-to-end tests (gloo ranks sharing the GPU, replicas and torch-path bits).
# Each step is bounded by its share of what is left (a step that overruns is killed and the
# next still runs); the last step gets the rest. Runs from a source checkout with the machine's
# own python3 (torch with CUDA, CuPy): nothing is installed, the repository root goes on
# PYTHONPATH. Logs, the bench JSON and a summary land in OUTDIR.
# Usage: bash bench/gpu_check.sh OUTDIR [TOTAL_SECONDS]
set -u
out=${1:?usage: gpu_check.sh OUTDIR [TOTAL_SECONDS]}
total=${2:-530}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
py=${PY:-python3}  # the machine's python with torch + CuPy
start=$(date +%s)
left() { echo $(( total - ($(date +%s) - start) )); }
# budget WANT: WANT seconds, or what is left minus a reserve for the later steps
budget() {
  local want=$1 reserve=${2:-0} l
  l=$(( $(left) - reserve ))
  [ "$want" -gt "$l" ] && want=$l
  [ "$want" -lt 10 ] && want=10
  echo "$want"
}
{
  date -u +%FT%TZ
  nvidia-smi -L
  $py -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cupy', cupy.__version__, torch.cuda.get_device_name(0))"
  echo "budget ${total}s"
} 2>&1 | tee "$out/facts.txt"

t=$(budget 170 330)
timeout "$t" $py -m pytest tests/gpu --ignore=tests/gpu/test_e2e_gpu.py -q -p no:cacheprovider -rfEs \
  --durations=10 2>&1 | tee "$out/gpu_tests.log"
echo "kernel tests rc=${PIPESTATUS[0]} (bound ${t}s, $(( $(date +%s) - start ))s so far)" | tee -a "$out/facts.txt"

t=$(budget 220 120)
timeout "$t" $py bench/kernels.py --sizes 25e6,100e6 --reps 20 --json "$out/kernels.json" \
  2>&1 | tee "$out/kernels.log"
echo "bench rc=${PIPESTATUS[0]} (bound ${t}s, $(( $(date +%s) - start ))s so far)" | tee -a "$out/facts.txt"

t=$(budget $(( $(left) - 5 )))
timeout "$t" $py -m pytest tests/gpu/test_e2e_gpu.py -q -p no:cacheprovider -rfEs --durations=5 \
  2>&1 | tee "$out/gpu_e2e.log"
echo "e2e tests rc=${PIPESTATUS[0]} (bound ${t}s, $(( $(date +%s) - start ))s in all)" | tee -a "$out/facts.txt"

{
  echo "== summary"
  tail -n 1 "$out/gpu_tests.log"
  tail -n 1 "$out/gpu_e2e.log"
  echo "targets met: $(grep -c ' met ' "$out/kernels.log")  missed: $(grep -c 'MISSED' "$out/kernels.log")"
  grep 'MISSED' "$out/kernels.log"
} 2>&1 | tee "$out/summary.txt"
