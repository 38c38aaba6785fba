#!/usr/bin/env bash
# The prepared GPU run: one command that ends within SUITE_BUDGET_S (default 450 s, of the
# 10 minutes a device command may take; call it with timeout_s of about 520: the budget,
# the last stage's 10 s kill grace and the packing), whose first minute says whether the
# rest is worth running. On an H200 every stage ran in 185-210 s, and with the machine's
# start a call took 4-6 of the 15 minutes of device time a lease gives.
#
#   1. preflight (40 s): bench/gpu_preflight.py -> preflight.json (torch, driver, kernel;
#      time to pin 4 GiB; pinned D2H/H2D GB/s; how long a non_blocking copy to pageable
#      memory takes to return; O_DIRECT through a pinned block; CUDA calls during a graph
#      capture, each case written as it ends)
#   2. tests/test_cuda.py (90 s), with faulthandler: a test past 15 s dumps every
#      thread's stack, and pytest-timeout (if this python has it) fails it at 20 s; the
#      stage's own limit sends SIGABRT, which faulthandler also answers with the stacks.
#      Without pytest the stage is recorded as skipped and the others run.
#   3. the step benchmark on the GPU (bench/step.py --device cuda), every lane in one
#      process: fp32, compute-bound: none, cpu, save_on_cpu (120 s), then one more step
#      per lane with allocated memory sampled every 10 ms, kept in gpu_fp32.json and
#      drawn to memory_fp32.png where matplotlib is installed; bf16: none, cpu, budget
#      (device_budget half the saved bytes) (90 s)
#   4. keep / offload / recompute (75 s): the comparison of bench/recompute.py --gpu
#      (a Hugging Face Llama in bf16 where transformers is installed, else the benchmark
#      transformer)
#   5. disk, only if the preflight measured O_DIRECT through pinned memory at 1 GB/s or
#      more (60 s): none and disk, bf16 at half the sequence (about 2.3 GB saved a step),
#      one warm-up and two timed steps
#
# Usage (repository root): bash bench/gpu_suite.sh [OUTDIR]   (default: $OUT, else
# gpu-suite-out). It uses the machine's python3 as it is (PYTHON overrides) and installs
# nothing. Every stage runs even if an earlier one failed (a lease is one shot), under
# its own limit, capped by what the budget has left; each prints its numbers as it goes
# and appends "NAME STATUS" to OUTDIR/rc.txt: its exit status, "skipped (why)", or
# no_time where the budget had less than 10 s left for it. The script exits non-zero if
# any stage failed or had no time.
#
# What comes back is at most 8 files (the device machine returns no more): the stages
# write into a work folder outside OUTDIR, which is packed into OUTDIR/results.tar.gz
# after every stage and on exit (an EXIT trap), beside OUTDIR/summary.txt (each stage's
# status and the targets' PASS/FAIL lines), OUTDIR/rc.txt and OUTDIR/live.log (every
# stage's output as it is printed, there even if a stage is killed). Unpack with
# tar -xzf results.tar.gz.
#
# SUITE_TWIN=1 runs every stage on the CPU at toy sizes through the CUDA path's twin, to
# check this script without a GPU (tests/test_gpu_suite.py runs it so). SUITE_STAGES (a
# comma list of preflight, tests, fp32, bf16, disk, recompute; default all; disk brings
# preflight, which decides whether it runs) runs some stages only: a first call of
# "preflight,tests" (about 3 minutes) leaves room in a short lease to rerun.
# The env stage always runs, and stops the script at once where torch sees no CUDA
# device, or where torch or numpy is missing or older than the engine needs.
set -u -o pipefail
out=${1:-${OUT:-gpu-suite-out}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # carried wheels kept
ulimit -c 0  # a stage aborted at its limit must not spend its grace writing a core
py=${PYTHON:-python3}
twin=${SUITE_TWIN:-0}
budget=${SUITE_BUDGET_S:-450}
reserve=15  # seconds kept for the last pack and the SIGKILL grace of a stage's timeout
stages=",${SUITE_STAGES:-preflight,tests,fp32,bf16,disk,recompute},"
all="preflight, tests, fp32, bf16, disk, recompute"
for s in ${stages//,/ }; do
  case $s in preflight|tests|fp32|bf16|disk|recompute) ;;
    *) echo "!! SUITE_STAGES: unknown stage '$s' ($all)"; exit 2;;
  esac
done
case $stages in *,disk,*) stages="${stages}preflight,";; esac
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-suite.XXXXXX")
failed=0
: > "$out/rc.txt"
: > "$out/live.log"

summary() {
  echo "gpu_suite $(date +%FT%T) twin=$twin: ${SECONDS} s of a ${budget} s budget"
  [ -f "$work/env.txt" ] && sed 's/^/env: /' "$work/env.txt"
  sed 's/^/stage: /' "$out/rc.txt"
  for f in gpu_fp32 gpu_bf16 gpu_disk; do
    [ -f "$work/$f.txt" ] && grep -E '^target ' "$work/$f.txt" | sed "s/^/$f /"
  done
  [ -f "$work/preflight.json" ] && $py -c "import json, sys
d = json.load(open(sys.argv[1]))
for k in ('link', 'pageable', 'direct_io', 'capture'):
    v = d.get(k)
    if isinstance(v, dict):
        keep = {n: x for n, x in v.items() if not isinstance(x, (dict, list))}
        print(f'preflight {k}:', json.dumps(keep))" "$work/preflight.json" 2>/dev/null
  echo "files: results.tar.gz ($(cd "$work" && find . -type f | wc -l) files:" \
    "$(cd "$work" && find . -type f | sed 's|^\./||' | sort | tr '\n' ' '))"
}
# pack: the work folder as OUTDIR/results.tar.gz, and OUTDIR/summary.txt, each replaced
# whole (a kill mid-pack leaves the previous ones).
pack() {
  tar -czf "$out/.results.tar.gz" -C "$work" . && mv -f "$out/.results.tar.gz" "$out/results.tar.gz"
  summary > "$out/.summary.txt" 2>&1; mv -f "$out/.summary.txt" "$out/summary.txt"
}
finish() {
  local rc=$?
  pack
  rm -rf "$work"
  exit $rc
}
trap finish EXIT
trap 'exit 143' TERM INT HUP

# want STAGE NAME: whether STAGE runs; if not, NAME is recorded as skipped.
want() { case "$stages" in *",$1,"*) return 0;; *) record "$2" skipped; return 1;; esac; }
stage() { echo "== $1 ($(date +%T), ${SECONDS} s in)"; }
record() {  # record NAME STATUS
  echo "$1 $2" >> "$out/rc.txt"
  case $2 in 0|skipped*) ;; *) echo "!! $1 exited $2"; failed=1;; esac
}
# step NAME LIMIT_S CMD...: run CMD under LIMIT_S, or what the budget has left if less;
# SIGABRT at the limit (faulthandler prints every thread's stack), SIGKILL 10 s later
# (status 124 when the limit was hit). Its output is shown (the last 40 lines where
# STEP_TAIL=1) and kept in WORK/NAME.txt; its status is recorded; the results are packed.
step() {
  local name=$1 limit=$2 left rc
  shift 2
  left=$(( budget - SECONDS - reserve ))
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  if [ "$limit" -lt 10 ]; then
    echo "!! $name: ${left} s left of the ${budget} s budget: not started"
    record "$name" "no_time"
    return
  fi
  # live.log: what the running stage printed so far is under $OUT even if it is killed.
  if [ "${STEP_TAIL:-0}" = 1 ]; then
    timeout -s ABRT -k 10 "$limit" "$@" 2>&1 | tee "$work/$name.txt" | tee -a "$out/live.log" \
      | tail -40
  else
    timeout -s ABRT -k 10 "$limit" "$@" 2>&1 | tee "$work/$name.txt" | tee -a "$out/live.log"
  fi
  rc=${PIPESTATUS[0]}
  record "$name" "$rc"
  pack
}

stage env
# Every probe outside a stage that may touch the driver has its own limit: a wedged
# driver must not take the lease.
{ if [ "$twin" = 1 ]; then echo "SUITE_TWIN=1: CPU twin, toy sizes"; else
    timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; fi
  timeout 60 $py -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  nproc; uname -a; df -h . | tail -1; } 2>&1 | tee "$work/env.txt"
# The engine's own floor (prefetch_offload.context.check_torch_version) and numpy: without
# them no stage can run, and the lease would go on import errors. pytest only the tests
# stage needs: it checks for it itself.
timeout 60 $py -c "import numpy, torch; from prefetch_offload.context import check_torch_version
check_torch_version(torch.__version__)" 2>&1 | tail -3
rc=$?
record requirements $rc
if [ $rc -ne 0 ]; then echo "!! $py lacks what the suite needs (above): nothing to run"; exit 1; fi
if [ "$twin" != 1 ]; then
  # Under a CPU build of torch every gpu_only test would skip and pytest would pass.
  timeout 60 $py -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"
  rc=$?
  record cuda_available $rc
  if [ $rc -ne 0 ]; then echo "!! torch sees no CUDA device: nothing to run"; exit 1; fi
fi
pack

stage "preflight (40 s)"
if want preflight preflight; then
  # The twin's disk stage checks this script, whatever the CI machine's disk does.
  gate=(); if [ "$twin" = 1 ]; then gate=(--disk-min-gbps 0); fi
  step preflight 40 $py -X faulthandler bench/gpu_preflight.py --json "$work/preflight.json" \
    "${gate[@]}"
fi

stage "CUDA tests"
if ! want tests tests_cuda; then
  :
elif ! $py -c "import pytest" 2>/dev/null; then
  echo "tests skipped: no pytest"
  record tests_cuda "skipped (no pytest)"
else
  # Each GPU test takes seconds: a hung one is cut at 20 s (its stack dumped at 15), not
  # left to take the stage; -v puts each test's name on disk as it runs.
  limits=(-o faulthandler_timeout=15)
  if $py -c "import pytest_timeout" 2>/dev/null; then limits+=(--timeout=20); fi
  # -W: the pytest configuration names pytest-asyncio's options, unknown without it.
  STEP_TAIL=1 step tests_cuda 90 $py -X faulthandler -m pytest -v -p no:cacheprovider \
    -W ignore::pytest.PytestConfigWarning -m gpu_only tests/test_cuda.py --maxfail=5 -rs \
    "${limits[@]}"
fi

if [ "$twin" = 1 ]; then
  size=(--device twin --width 32 --depth 2 --heads 2 --vocab 64 --seq 16 --batch 2 --steps 2
        --warmup 1 --knobs '{"min_offload_bytes": 0, "chunk_bytes": 16384}')
  fp32=("${size[@]}"); bf16=("${size[@]}"); disk=("${size[@]}")
  recompute=(--twin)
else
  # Explicit attention: fused attention kernels may use atomics, which no offload can make
  # reproducible, and the parameters are compared bit for bit.
  fp32=(--device cuda --width 4096 --depth 4 --heads 32 --vocab 8192 --seq 1024 --batch 4
        --steps 5 --warmup 2)
  bf16=(--device cuda --width 2048 --depth 4 --heads 16 --vocab 8192 --seq 2048 --batch 4
        --steps 5 --warmup 2)
  disk=(--device cuda --width 2048 --depth 4 --heads 16 --vocab 8192 --seq 1024 --batch 4
        --steps 2 --warmup 1)
  # The modes that decide issue 23's targets at one budget (each mode is a process that
  # builds the model: all eleven would not fit the stage).
  recompute=(--modes none,offload25,full,full_offload,selective,auto25)
fi

stage "fp32, compute-bound: none, cpu, save_on_cpu"
if want fp32 gpu_fp32; then
  step gpu_fp32 120 $py -X faulthandler bench/step.py --shared --dtype fp32 "${fp32[@]}" \
    --modes none,cpu,save_on_cpu --json "$work/gpu_fp32.json" --plot "$work/memory_fp32.png"
fi

stage "bf16: none, cpu, budget"
if want bf16 gpu_bf16; then
  # 3 lanes x (warmup + steps) steps of at most 0.2 s at this size (about 4.7 GB saved
  # a step) and the engines' pinned arenas: about 20 s on an H200.
  step gpu_bf16 90 $py -X faulthandler bench/step.py --shared --dtype bf16 "${bf16[@]}" \
    --modes none,cpu,budget --json "$work/gpu_bf16.json"
fi

stage "keep / offload / recompute"
if want recompute recompute; then
  step recompute 75 $py -X faulthandler bench/recompute.py --gpu "${recompute[@]}" \
    --json "$work/recompute.json"
fi

stage "disk (only with O_DIRECT at 1 GB/s or more)"
if ! want disk gpu_disk; then
  :
elif timeout 60 $py -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['direct_io']['disk_ok'] else 1)" \
    "$work/preflight.json" 2>/dev/null; then
  step gpu_disk 60 $py -X faulthandler bench/step.py --shared --dtype bf16 "${disk[@]}" \
    --modes none,disk --json "$work/gpu_disk.json"
else
  echo "skipped: the preflight did not measure O_DIRECT at 1 GB/s or more (see direct_io)"
  record gpu_disk "skipped (no fast O_DIRECT)"
fi

stage done
cat "$out/rc.txt"
exit $failed
