#!/usr/bin/env bash
# The prepared GPU run: the CUDA tests, then bench/gpu.py at two shapes, in one go.
# Usage (on a CUDA machine, from the repository root): bash bench/gpu_suite.sh [OUTDIR]
# Each stage has its own time limit so that one hang cannot eat the whole lease; every
# stage runs even if an earlier one failed (a lease is one shot), each stage's exit
# status goes to OUTDIR/rc.txt, and the script exits non-zero if any stage failed.
set -u -o pipefail
out=${1:-${OUT:-gpu-suite-out}}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
failed=0
: > "$out/rc.txt"
stage() { echo "== $1 ($(date +%T))"; }
record() {  # record NAME RC
  echo "$1 $2" >> "$out/rc.txt"
  if [ "$2" -ne 0 ]; then echo "!! $1 exited $2"; failed=1; fi
}

stage env
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $py -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  nproc; df -h . | tail -1; } 2>&1 | tee "$out/env.txt"
# Under a CPU build of torch every gpu_only test would skip and pytest would pass.
$py -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"
rc=$?
record cuda_available $rc
if [ $rc -ne 0 ]; then echo "!! torch sees no CUDA device: nothing to run"; exit 1; fi

stage "CUDA tests"
timeout -k 10 180 $py -m pytest -q -p no:cacheprovider -m gpu_only tests/test_cuda.py \
  --maxfail=5 -rs 2>&1 | tee "$out/tests_cuda.txt" | tail -25
record tests_cuda $?

stage "bf16, every mode"
timeout -k 10 150 $py bench/gpu.py --dtype bf16 --attention sdpa --width 2048 --depth 4 \
  --heads 16 --seq 2048 --batch 4 --steps 5 --warmup 2 --disk-probe-mb 2048 \
  --json "$out/gpu_bf16.json" 2>&1 | tee "$out/gpu_bf16.txt"
record gpu_bf16 $?

stage "fp32 (compute-heavy), without disk"
timeout -k 10 120 $py bench/gpu.py --dtype fp32 --attention sdpa --width 4096 --depth 4 \
  --heads 32 --seq 1024 --batch 4 --steps 5 --warmup 2 --modes none,cpu,save_on_cpu,ondemand \
  --json "$out/gpu_fp32.json" 2>&1 | tee "$out/gpu_fp32.txt"
record gpu_fp32 $?
stage done
cat "$out/rc.txt"
exit $failed
