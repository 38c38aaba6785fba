#!/usr/bin/env bash
# The prepared GPU run: one command, at most 8.5 minutes, whose first minute says whether
# the rest is worth running.
#
#   1. preflight (40 s): bench/gpu_preflight.py -> OUTDIR/preflight.json (torch, driver,
#      kernel; time to pin 4 GiB; pinned D2H/H2D GB/s; how long a non_blocking copy to
#      pageable memory takes to return; O_DIRECT through a pinned block; CUDA calls
#      during a graph capture)
#   2. tests/test_cuda.py (150 s), with faulthandler: a test past 60 s dumps every
#      thread's stack, and pytest-timeout (if this python has it) fails it at 90 s; the
#      stage's own limit sends SIGABRT, which faulthandler also answers with the stacks
#   3. fp32, compute-bound: none, cpu, save_on_cpu, ondemand (110 s); then one more
#      step per mode with torch.cuda.memory_allocated sampled every 0.5 ms, kept in
#      gpu_fp32.json and drawn to memory_fp32.png where matplotlib is installed
#      (elsewhere: python bench/gpu.py --replot gpu_fp32.json --plot memory_fp32.png)
#   4. bf16: none, cpu, budget, copybudget (100 s): cpu against none (issue 14), and
#      budget (device_budget half the saved bytes) against its budget, cpu and
#      copybudget, a bare side stream moving the same bytes (issue 13's targets)
#   5. disk, only if the preflight measured O_DIRECT through pinned memory at 1 GB/s or
#      more (90 s)
#
# Usage (repository root): bash bench/gpu_suite.sh [OUTDIR]   (default: $OUT, else
# gpu-suite-out). It uses the machine's python3 as it is (PYTHON overrides) and installs
# nothing. Every stage runs even if an earlier one failed (a lease is one shot), prints
# its numbers as it goes, and appends "NAME STATUS" to OUTDIR/rc.txt; the script exits
# non-zero if any stage failed. SUITE_TWIN=1 runs every stage on the CPU at toy sizes
# through the CUDA path's twin, to check this script without a GPU. SUITE_STAGES (a comma
# list of preflight, tests, fp32, bf16, disk; default all; disk brings preflight, which
# decides whether it runs) runs some stages only: a first call of "preflight,tests"
# (about 3 minutes) leaves room in a short lease to rerun.
# The env stage always runs, and stops the script at once where torch sees no CUDA
# device, or where torch, numpy or pytest is missing or older than the engine needs.
set -u -o pipefail
out=${1:-${OUT:-gpu-suite-out}}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
twin=${SUITE_TWIN:-0}
stages=",${SUITE_STAGES:-preflight,tests,fp32,bf16,disk},"
for s in ${stages//,/ }; do
  case $s in preflight|tests|fp32|bf16|disk) ;;
    *) echo "!! SUITE_STAGES: unknown stage '$s' (preflight, tests, fp32, bf16, disk)"; exit 2;;
  esac
done
case $stages in *,disk,*) stages="${stages}preflight,";; esac
# want STAGE NAME: whether STAGE runs; if not, NAME is recorded as skipped.
want() { case "$stages" in *",$1,"*) return 0;; *) record "$2" skipped; return 1;; esac; }
failed=0
: > "$out/rc.txt"
stage() { echo "== $1 ($(date +%T))"; }
record() {  # record NAME STATUS
  echo "$1 $2" >> "$out/rc.txt"
  if [ "$2" != 0 ] && [ "$2" != skipped ]; then echo "!! $1 exited $2"; failed=1; fi
}
# run LIMIT_S CMD...: SIGABRT at the limit (faulthandler prints every thread's stack),
# SIGKILL 10 s later; exit status 124 when the limit was hit.
run() { local limit=$1; shift; timeout -s ABRT -k 10 "$limit" "$@"; }

stage env
{ if [ "$twin" = 1 ]; then echo "SUITE_TWIN=1: CPU twin, toy sizes"; else
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; fi
  $py -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  nproc; uname -a; df -h . | tail -1; } 2>&1 | tee "$out/env.txt"
# The engine's own floor (prefetch_offload.context.check_torch_version), numpy, pytest:
# a stage that cannot run would spend the lease on import errors.
$py -c "import numpy, pytest, torch; from prefetch_offload.context import check_torch_version
check_torch_version(torch.__version__)" 2>&1 | tail -3
rc=$?
record requirements $rc
if [ $rc -ne 0 ]; then echo "!! $py lacks what the suite needs (above): nothing to run"; exit 1; fi
if [ "$twin" != 1 ]; then
  # Under a CPU build of torch every gpu_only test would skip and pytest would pass.
  $py -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"
  rc=$?
  record cuda_available $rc
  if [ $rc -ne 0 ]; then echo "!! torch sees no CUDA device: nothing to run"; exit 1; fi
fi

stage "preflight (40 s)"
if want preflight preflight; then
  run 40 $py -X faulthandler bench/gpu_preflight.py --json "$out/preflight.json" 2>&1 \
    | tee "$out/preflight.txt"
  record preflight $?
fi

stage "CUDA tests"
if want tests tests_cuda; then
  limits=(-o faulthandler_timeout=60)
  if $py -c "import pytest_timeout" 2>/dev/null; then limits+=(--timeout=90); fi
  run 150 $py -X faulthandler -m pytest -q -p no:cacheprovider -m gpu_only tests/test_cuda.py \
    --maxfail=5 -rs "${limits[@]}" 2>&1 | tee "$out/tests_cuda.txt" | tail -40
  record tests_cuda $?
fi

if [ "$twin" = 1 ]; then
  size=(--twin --width 32 --depth 2 --heads 2 --vocab 64 --seq 16 --batch 2 --steps 2
        --warmup 1 --min-offload-bytes 0 --chunk-bytes 16384)
  fp32=("${size[@]}"); bf16=("${size[@]}"); disk=("${size[@]}" --disk-probe-mb 8)
else
  fp32=(--attention sdpa --width 4096 --depth 4 --heads 32 --seq 1024 --batch 4 --steps 5
        --warmup 2)
  bf16=(--attention sdpa --width 2048 --depth 4 --heads 16 --seq 2048 --batch 4 --steps 5
        --warmup 2)
  disk=("${bf16[@]}" --disk-probe-mb 1024)
fi

stage "fp32, compute-bound: none, cpu, save_on_cpu, ondemand"
if want fp32 gpu_fp32; then
  run 110 $py -X faulthandler bench/gpu.py --dtype fp32 "${fp32[@]}" \
    --modes none,cpu,save_on_cpu,ondemand --json "$out/gpu_fp32.json" \
    --plot "$out/memory_fp32.png" 2>&1 \
    | tee "$out/gpu_fp32.txt"
  record gpu_fp32 $?
fi

stage "bf16: none, cpu, budget, copybudget"
if want bf16 gpu_bf16; then
  # The limit is an estimate (no GPU has run this stage): 4 modes x (1 + warmup + steps)
  # steps of well under 0.2 s at this size (about 2.7 GB saved), the link probe, the
  # budget engine's pinned arena and copybudget's buffers (saved - budget bytes on the
  # GPU and pinned), with the margin 80 s gives two modes.
  run 100 $py -X faulthandler bench/gpu.py --dtype bf16 "${bf16[@]}" \
    --modes none,cpu,budget,copybudget --json "$out/gpu_bf16.json" 2>&1 \
    | tee "$out/gpu_bf16.txt"
  record gpu_bf16 $?
fi

stage "disk (only with O_DIRECT at 1 GB/s or more)"
if ! want disk gpu_disk; then
  :
elif $py -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['direct_io']['disk_ok'] else 1)" \
    "$out/preflight.json" 2>/dev/null; then
  run 90 $py -X faulthandler bench/gpu.py --dtype bf16 "${disk[@]}" --modes none,cpu,disk \
    --json "$out/gpu_disk.json" 2>&1 | tee "$out/gpu_disk.txt"
  record gpu_disk $?
else
  echo "skipped: the preflight did not measure O_DIRECT at 1 GB/s or more (see direct_io)"
  record gpu_disk skipped
fi

stage done
cat "$out/rc.txt"
exit $failed
