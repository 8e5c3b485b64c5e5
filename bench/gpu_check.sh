#!/usr/bin/env bash
# One GPU, one call: the kernels' bit-identity and end-to-end tests, then the kernel bench.
# Usage: bash bench/gpu_check.sh OUTDIR [TEST_SECONDS] [BENCH_SECONDS]
# Runs from a source checkout with the machine's own python3 (torch with CUDA, CuPy): nothing is
# installed; the repository root goes on PYTHONPATH. Logs and the bench JSON land in OUTDIR.
set -u
out=${1:?usage: gpu_check.sh OUTDIR [TEST_SECONDS] [BENCH_SECONDS]}
t_tests=${2:-180}
t_bench=${3:-120}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  date -u +%FT%TZ
  nvidia-smi -L
  python3 -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cupy', cupy.__version__, torch.cuda.get_device_name(0))"
  uptime
} 2>&1 | tee "$out/facts.txt"
timeout "$t_tests" python3 -m pytest tests/gpu -q -p no:cacheprovider -rfEs --durations=10 \
  2>&1 | tee "$out/gpu_tests.log"
echo "tests rc=${PIPESTATUS[0]}" | tee -a "$out/facts.txt"
timeout "$t_bench" python3 bench/kernels.py --sizes 25e6,100e6 --reps 20 --json "$out/kernels.json" \
  2>&1 | tee "$out/kernels.log"
echo "bench rc=${PIPESTATUS[0]}" | tee -a "$out/facts.txt"
