#!/usr/bin/env bash
# The prepared GPU run: the CUDA tests, then bench/gpu.py at two shapes, in one go.
# Usage (on a CUDA machine, from the repository root): bash bench/gpu_suite.sh [OUTDIR]
# Each stage has its own time limit so that one hang cannot eat the whole lease.
set -u
out=${1:-${OUT:-gpu-suite-out}}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
stage() { echo "== $1 ($(date +%T))"; }

stage env
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $py -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  nproc; df -h . | tail -1; } 2>&1 | tee "$out/env.txt"

stage "CUDA tests"
timeout 180 $py -m pytest -q -p no:cacheprovider -m gpu_only tests/test_cuda.py -x -rs 2>&1 \
  | tee "$out/tests_cuda.txt" | tail -25

stage "bf16, every mode"
timeout 150 $py bench/gpu.py --dtype bf16 --attention sdpa --width 2048 --depth 4 --heads 16 \
  --seq 2048 --batch 4 --steps 5 --warmup 2 --disk-probe-mb 2048 \
  --json "$out/gpu_bf16.json" 2>&1 | tee "$out/gpu_bf16.txt"

stage "fp32 (compute-heavy), without disk"
timeout 120 $py bench/gpu.py --dtype fp32 --attention sdpa --width 4096 --depth 4 --heads 32 \
  --seq 1024 --batch 4 --steps 5 --warmup 2 --modes none,cpu,save_on_cpu,ondemand \
  --json "$out/gpu_fp32.json" 2>&1 | tee "$out/gpu_fp32.txt"
stage done
