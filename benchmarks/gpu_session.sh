#!/usr/bin/env bash
# The GPU checks of issues 11, 12 and 13, in three calls of the device tool, each under its 10-minute
# limit (a session gets 30 minutes of GPU time, start-up included). On the GPU machine, from a copy of the
# project root that holds .gpu/ (../shared/gpu/README.md):
#
#   bash .gpu/setup.sh && export PYTHONPATH=/tmp/site && bash benchmarks/gpu_session.sh tests
#   bash .gpu/setup.sh && export PYTHONPATH=/tmp/site && bash benchmarks/gpu_session.sh bench
#   bash .gpu/setup.sh && export PYTHONPATH=/tmp/site && bash benchmarks/gpu_session.sh scale
#
# A session lent 15 minutes of device time (start-up included) has one such call: `short` (about 6 minutes)
# runs the compact kernels against their bandwidth floor on the machine's 16 cores, bench_gpu.py's 124M table,
# then the whole suite with CUDA present (tests/gpu first).
#
# tests: the whole suite with CUDA present, tests/gpu (parity with plain PyTorch on the device) first.
# bench: bench_gpu.py (124M and 1.3B, every tier, accumulation 1 and 4, against plain PyTorch; the nvme
#        case against the disk; spill against cpu), then the compact states on a disk-bound 1.3B, then the
#        gradient norm against torch on 16 cores (bench_grad_norm.py).
# scale: the largest GPT on one GPU with host memory and NVMe: 13B with int8 states under a 100 GiB budget
#        (6.7B with fp32 states: bench_scale.py --presets 6.7b --host-memory 100GiB --max-rss 120GiB).
#
# The limits add up to ~25 minutes, leaving the rest of the 30 for the machine's start. Run the phases in
# this order (most needed first), one right after the other, so the machine stays warm between them.
#
# Every log and JSON line goes under $OUT (the device tool brings it back), written as it comes, so a
# phase cut off by its time limit still returns what it finished. Swap files go under a temporary folder
# and are removed. Each step has its own `timeout`, so one slow step cannot eat the next one's time.

set -u
phase=${1:?"usage: gpu_session.sh tests|bench|scale|short"}
case $phase in tests|bench|scale|short) ;; *) echo "unknown phase $phase: tests, bench, scale or short" >&2; exit 2 ;; esac
out=${OUT:-/tmp/gpu-session}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $out/NAME.log, note the exit status
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s): $*" | tee -a "$out/phases.log"
  local start=$SECONDS
  # SIGINT first, so a cut-off pytest still prints its summary; KILL 20 s later if it has not stopped
  timeout -s INT -k 20 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$out/phases.log"
  tail -n 15 "$out/$name.log"
}

whole_suite_in_two() {  # tests/gpu and tests/unit here, tests/distributed beside them; fails if either fails
  # its own log under $out (the eighth file back), written as it goes, so a cut-off run still returns it; 8 threads
  # each, so the two processes do not oversubscribe the 16 cores
  local side="$out/tests-distributed.log"
  OMP_NUM_THREADS=8 "$py" -m pytest -q -rfs -p no:cacheprovider tests/distributed > "$side" 2>&1 &
  local distributed=$!
  OMP_NUM_THREADS=8 "$py" -m pytest -q -rfs --durations=15 -p no:cacheprovider tests/gpu tests/unit
  local rest=$?
  wait "$distributed"
  local rc=$?
  echo "== tests/distributed (tests-distributed.log): $(tail -n 1 "$side")"
  return $((rest | rc))
}
export -f whole_suite_in_two
export py out

{ nvidia-smi; nproc; free -g; df -h /tmp; } > "$out/machine-$phase.txt" 2>&1

case $phase in
  tests)
    # the C++ kernel's first build (tens of seconds on a fresh machine) in its own step, not in a test's time
    step kernel-build 120 "$py" -c "import infinity.kernels as k; print('CPU Adam kernel:', k.backend())"
    step tests-all 400 bash -c whole_suite_in_two
    ;;
  bench)
    step bench-gpu-124m 140 "$py" benchmarks/bench_gpu.py --models 124m --rounds 3 --warmup 1 \
      --out "$out/bench_gpu_124m.json"
    # the issue's 1.3B targets first (rows print as they finish, so a cut-off run still returns them)
    step bench-gpu-1.3b 300 "$py" benchmarks/bench_gpu.py --models 1.3b --cases none:4,cpu:4,cpu:1,nvme:1,spill:1 \
      --rounds 3 --warmup 1 --out "$out/bench_gpu_1.3b.json"
    step bench-compact 100 "$py" benchmarks/bench_compact.py --layers 24 --d-model 2048 --heads 16 \
      --precision bf16 --steps 2 --warmup 1
    step bench-grad-norm 20 "$py" benchmarks/bench_grad_norm.py --numel 100000000 --rounds 5
    step bench-adam-16-cores 60 "$py" benchmarks/bench_adam.py --rounds 7 --cases bf16s,int8s
    ;;
  short)
    step kernel-build 90 "$py" -c "import infinity.kernels as k; print('CPU Adam kernel:', k.backend())"
    # issue 13's last item: the compact kernels against their memory-bandwidth floor on 16 cores (on 2 vCPUs
    # int8 is bound by its instructions, 1.5-1.8x the floor); short steps first, so a slow suite cannot cut them
    step bench-adam-16-cores 60 "$py" benchmarks/bench_adam.py --rounds 9 --cases bf16s,int8s
    step bench-gpu-124m 110 "$py" benchmarks/bench_gpu.py --models 124m --rounds 2 --warmup 1 \
      --out "$out/bench_gpu_124m.json"
    # the whole suite with CUDA present (889 tests took ~370 s in one process, past this step's share of the
    # 10-minute call): the multi-rank tests in a second pytest beside the rest, on the 16 cores
    step tests-all 320 bash -c whole_suite_in_two
    ;;
  scale)
    step scale-13b-int8 420 "$py" benchmarks/bench_scale.py --presets 13b --optimizer-state-dtype int8 \
      --steps 3 --lr 1e-6 --host-memory 100GiB --max-rss 120GiB --out "$out/scale-13b-int8.json"
    ;;
esac
