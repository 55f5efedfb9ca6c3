#!/usr/bin/env bash
# GPU checks of zero-infinity on a machine with a CUDA GPU: the offloaded step's targets against plain PyTorch and
# the step-time model, a model whose optimizer states do not fit the GPU, the largest GPT one GPU trains with host
# memory and NVMe, the test suite with CUDA present. A phase ends within its time (GPU_CHECK_PHASE_S, default 540 s:
# a ten-minute call with the project's setup before it).
#
# In a Python whose torch has CUDA, with the project installed (`pip install -e '.[test,hf]'`;
# without the system libaio the storage engine uses its threads backend):
#
#   bash benchmarks/gpu_check.sh step      # ~7 min: the offloaded step's targets, first what decides them: the
#                                          #   machine's figures (bench --machine), then 1.3B against plain PyTorch
#                                          #   with the step-time model's prediction in each row (cpu with fp32 and
#                                          #   int8 states, half the optimizer on the device, accumulation 4 with
#                                          #   and without every parameter kept gathered until the step; each
#                                          #   traced), a 6.7B whose states do not fit the GPU (cpu against auto,
#                                          #   tokens/s and TFLOP/s), 124M (none, cpu, accumulation 4), and
#                                          #   the engine's host-side work per tensor (bench_host_overhead.py)
#   bash benchmarks/gpu_check.sh step-more # ~3 min, the same machine's next call: the other offloaded 1.3B rows
#                                          #   (the CPU Adam unbound, spill against cpu, nvme against the disk)
#   bash benchmarks/gpu_check.sh model     # ~3 min: fresh figures, then the 1.3B cpu and int8 rows beside their
#                                          #   predictions, traced, and the host-side work per tensor: a lease's
#                                          #   short second call after `scale`
#   bash benchmarks/gpu_check.sh scale     # ~8 min: the largest GPT this box holds (estimate --max-params), then a
#                                          #   20.4B GPT with int8 states in 110 GiB of host memory and NVMe, 3 steps
#   bash benchmarks/gpu_check.sh tests     # ~6 min: the whole suite with CUDA present: tests/gpu and tests/unit, with
#                                          #   tests/distributed (the multi-rank tests) in a second pytest beside them
#   bash benchmarks/gpu_check.sh versions  # ~9 min: every tree under .versions/ against the working tree and plain
#                                          #   PyTorch (bench_versions.py): 1.3B, everything on the CPU, then the
#                                          #   optimizer alone on the CPU
#   bash benchmarks/gpu_check.sh bench     # ~9 min: bench_gpu.py's whole table at 124M and 1.3B, the CPU Adam beside
#                                          #   a feeding thread, the compact states on a disk-bound 1.3B
#   bash benchmarks/gpu_check.sh quick     # ~6 min: the compact kernels against their floor, 124M, the whole suite
#   bash benchmarks/gpu_check.sh all       # step, step-more, scale, tests, one after the other
#
# A lease of 15 minutes of device time (a minute or two of it to start the machine) holds one ten-minute call and
# one short one: `step` then `step-more`, or `scale` then `model`; the next lease takes the next phase. Set up and
# run in one call, e.g. with ../shared/gpu copied to .gpu/ here (and, for `versions`, `bash benchmarks/versions.sh`
# run here and ".versions" added to carry):
#   run(command="bash .gpu/setup.sh && export PYTHONPATH=/tmp/site && OUT=$OUT bash benchmarks/gpu_check.sh scale",
#       carry=[".gpu"], timeout_s=600)
#   run(command="export PYTHONPATH=/tmp/site && OUT=$OUT GPU_CHECK_PHASE_S=170 bash benchmarks/gpu_check.sh model",
#       timeout_s=190)                    # at once, while the machine is warm (it keeps /tmp/site)
#
# The versions trees are each old commit's infinity/, kernels/ and storage/ under .versions/ (made by
# `bash benchmarks/versions.sh [COMMIT...]` where git history is at hand: ~1 MB each), timed beside the working tree.
# .versions is ignored by git, so a copy of the working tree without history (the device tool's) takes it along only
# when asked (the carry list above). Nothing needs installing: each tree is imported from its own folder and builds its
# own C++ kernel (under ~/.cache/zero-infinity-versions/NAME).
#
# (6.7B with fp32 states: python benchmarks/bench_scale.py --presets 6.7b --host-memory 100GiB --max-rss 120GiB.
#  The scale phase wants ~125 GiB of host memory and ~55 GiB free on the disk of $TMPDIR: the 20b run needs about
#  53 GiB of swap there; with less it is skipped and says so, and estimate-max says what this box holds instead.)
#
# Logs go under $OUT (default ./gpu-check-logs), flat, at most eight files a phase: phases.log (the machine, then
# each step's command, limit, exit status and seconds) and one NAME.log per step, written as the step runs, so a
# step cut off by its limit still leaves what it printed. Benchmarks print a JSON line last. Swap files go under
# temporary folders the benchmarks remove.
#
# Each step has its own limit, and no step runs past the phase's, so one slow step cannot eat the next one's time.
# At a limit the step gets SIGINT first, so a cut-off pytest still prints its summary, then KILL 20 s later if it
# has not stopped.
#   PYTHON=python3.12 bash benchmarks/gpu_check.sh tests    # another interpreter

set -u
usage="usage: gpu_check.sh step|step-more|model|scale|tests|versions|bench|quick|all"
phase=${1:?$usage}
case $phase in step|step-more|model|scale|tests|versions|bench|quick|all) ;; *) echo "unknown phase $phase; $usage" >&2; exit 2 ;; esac
out=${OUT:-./gpu-check-logs}
py=${PYTHON:-python3}
phase_s=${GPU_CHECK_PHASE_S:-540}
grace_s=20
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."  # the project root: the steps name tests/ and benchmarks/ from there
export PYTHONUNBUFFERED=1

if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "no CUDA GPU visible to $py (torch.cuda.is_available() is False): nothing to check here" >&2
  exit 2
fi

failed=0
deadline=0

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $out/NAME.log, note the exit status
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - SECONDS - grace_s))
  if ((left < limit)); then limit=$left; fi
  if ((limit < 10)); then
    echo "== $name: skipped, the phase's ${phase_s} s are spent" | tee -a "$out/phases.log"
    failed=1
    return
  fi
  echo "== $name (limit ${limit} s): $*" | tee -a "$out/phases.log"
  local start=$SECONDS
  # SIGINT first, so a cut-off pytest still prints its summary; KILL $grace_s s later if it has not stopped
  timeout -s INT -k "$grace_s" "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$out/phases.log"
  tail -n 15 "$out/$name.log"
  if ((rc != 0)); then failed=1; fi
}

whole_suite_in_two() {  # tests/gpu and tests/unit here, tests/distributed beside them; fails if either fails
  # the multi-rank tests' own log under $out, written as it goes, so a cut-off run still leaves it; 8 threads
  # for each of the two processes, so together they do not oversubscribe a 16-core host
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

version_trees() {  # --tree NAME=PATH for each tree under .versions/ (oldest commit first), then the working tree
  local date name
  while read -r date name; do printf -- '--tree %s=.versions/%s ' "$name" "$name"; done < <(
    for marker in .versions/*/COMMIT; do
      [[ -f $marker ]] && echo "$(cut -d' ' -f2 "$marker") $(basename "$(dirname "$marker")")"
    done | sort)
  printf -- '--tree head=.'
}
export py out

run_phase() {
  local name=$1
  deadline=$((SECONDS + phase_s))
  { echo "== phase $name"; nvidia-smi; nproc; free -g; df -h "${TMPDIR:-/tmp}"; } >> "$out/phases.log" 2>&1
  case $name in
    step)
      step kernel-build 90 "$py" -c "import infinity.kernels as k; print('CPU Adam kernel:', k.backend())"
      # the figures the step-time model predicts every row from, measured once and logged (the benchmarks read the
      # cache this writes)
      step machine-figures 60 "$py" -m infinity.cli bench --machine --json
      # the offloaded step's targets first, rows printed as they finish so a cut-off run still leaves them: cpu with
      # fp32 and int8 states, half the optimizer on the device, accumulation 4 (and with every parameter kept
      # gathered until the step); where each row's step goes (trace)
      step bench-gpu-1.3b 260 "$py" benchmarks/bench_gpu.py --models 1.3b --cases cpu:1,int8:1,half:1,cpu:4,keep:4 \
        --rounds 3 --warmup 1 --trace "$out" --trace-cases cpu:1,int8:1,half:1,cpu:4,keep:4 \
        --out "$out/bench-gpu-1.3b.json"
      # a model whose states do not fit the GPU (no plain PyTorch row: 107 GB of training state): auto against cpu,
      # every block recomputed so that activations leave the device budget room; fp32 states in 110 GiB of host
      step bench-gpu-6.7b 200 "$py" benchmarks/bench_gpu.py --models 6.7b --cases cpu:1,auto:1 \
        --activation-checkpointing --host-memory 110GiB --rounds 2 --warmup 1 --out "$out/bench-gpu-6.7b.json"
      # the small model, whose offloaded step the host-side work per tensor weighs on most
      step bench-gpu-124m 60 "$py" benchmarks/bench_gpu.py --models 124m --cases none:1,cpu:1,cpu:4 --rounds 3 \
        --warmup 1 --trace "$out" --trace-cases cpu:1 --out "$out/bench-gpu-124m.json"
      # that host-side work alone: 124M's tensors at next to no compute, ours against plain PyTorch
      step bench-host-overhead 40 "$py" benchmarks/bench_host_overhead.py --out "$out/bench-host-overhead.json"
      ;;
    model)
      # the step-time model on fresh figures against the two 1.3B rows it predicts most simply (~3 min): a
      # lease's short second call
      step kernel-build 90 "$py" -c "import infinity.kernels as k; print('CPU Adam kernel:', k.backend())"
      step machine-figures 60 "$py" -m infinity.cli bench --machine --json
      step bench-gpu-1.3b 120 "$py" benchmarks/bench_gpu.py --models 1.3b --cases cpu:1,int8:1 --rounds 2 \
        --warmup 1 --trace "$out" --trace-cases cpu:1,int8:1 --out "$out/bench-gpu-1.3b.json"
      # the engine's host-side work per tensor (what 124M's offloaded rows wait for), ours against plain PyTorch
      step bench-host-overhead 30 "$py" benchmarks/bench_host_overhead.py --out "$out/bench-host-overhead.json"
      ;;
    step-more)
      # the nvme row alone takes ~60 s at 1.3B (19 s a step): one round each, of one step
      step bench-gpu-1.3b-more 150 "$py" benchmarks/bench_gpu.py --models 1.3b --cases unbound:1,spill:1,nvme:1 \
        --rounds 1 --block 1 --warmup 1 --out "$out/bench-gpu-1.3b-more.json"
      ;;
    quick)

      step kernel-build 90 "$py" -c "import infinity.kernels as k; print('CPU Adam kernel:', k.backend())"
      # the short steps first, so a slow suite cannot cut them
      step bench-adam 60 "$py" benchmarks/bench_adam.py --rounds 9 --cases bf16s,int8s
      step bench-gpu-124m 110 "$py" benchmarks/bench_gpu.py --models 124m --rounds 2 --warmup 1
      step tests-all 300 bash -c whole_suite_in_two
      ;;
    tests)
      # the C++ kernel's first build (tens of seconds on a fresh machine) in its own step, not in a test's time
      step kernel-build 120 "$py" -c "import infinity.kernels as k; print('CPU Adam kernel:', k.backend())"
      step tests-all 420 bash -c whole_suite_in_two
      ;;
    bench)
      step bench-gpu-124m 120 "$py" benchmarks/bench_gpu.py --models 124m --rounds 3 --warmup 1
      # the CPU Adam beside a feeding thread: its team on every core, or bound off the first (as the engine binds it)
      step bench-host-threads 30 "$py" benchmarks/bench_host_threads.py --rounds 5 --seconds 1 --numel 20000000
      # rows print as they finish, so a cut-off run still leaves them
      # the offloaded step's targets: cpu with fp32 and int8 states, half the optimizer on the device, accumulation 4
      step bench-gpu-1.3b 330 "$py" benchmarks/bench_gpu.py --models 1.3b \
        --cases cpu:1,int8:1,half:1,none:4,cpu:4,nvme:1,spill:1,unbound:1 --rounds 3 --warmup 1 \
        --trace "$out" --trace-cases cpu:1 --profile  # where the cpu row's step goes: our trace and torch.profiler's
      step bench-compact 100 "$py" benchmarks/bench_compact.py --layers 24 --d-model 2048 --heads 16 \
        --precision bf16 --steps 2 --warmup 1
      ;;
    scale)
      # what this box holds: the largest GPT of our presets' shape for the run below's setting and budget
      step estimate-max 30 "$py" -m infinity.cli estimate --max-params --offload-param nvme --offload-optimizer nvme \
        --optimizer-state-dtype int8 --host-memory 110GiB --seq-len 16
      # >= 20B: int8 states (a bf16 master + 8-bit moments) in host memory as far as 110 GiB holds them beside the
      # bf16 gradients, the rest and the compute shards on NVMe; the disk measured first (8 GiB, the engine's blocks)
      step scale-20b-int8 480 "$py" benchmarks/bench_scale.py --presets 20b --optimizer-state-dtype int8 \
        --steps 3 --lr 1e-6 --host-memory 110GiB --max-rss 120GiB --disk-bench-size 8GiB \
        --out "$out/scale-20b-int8.json"
      ;;
    versions)
      if ! compgen -G ".versions/*/COMMIT" > /dev/null; then
        echo "== versions: no trees under .versions/ (bash benchmarks/versions.sh, then carry .versions)" \
          | tee -a "$out/phases.log"
        failed=1
        return
      fi
      # shellcheck disable=SC2046  # one word per argument: the trees' names and paths hold no spaces
      # bench_gpu.py's cpu case (the 11.75x row): each tree and plain PyTorch alternating, a process per run;
      # the trees' C++ kernels build in parallel first (--budget-s: no round starts that would end past it)
      step versions-1.3b-cpu 400 "$py" benchmarks/bench_versions.py $(version_trees) --model 1.3b \
        --micro-batch 8 --seq 1024 --offload-param cpu --offload-optimizer cpu --sub-group-size 1e8 --grad-accum 1 \
        --rounds 3 --steps 3 --warmup 2 --run-timeout 150 --budget-s 360 --out "$out/versions-1.3b-cpu.json"
      # the optimizer alone offloaded (parameters on the GPU: ZeRO-Offload's shape), in what the phase has left
      # shellcheck disable=SC2046
      step versions-1.3b-optimizer-cpu 150 "$py" benchmarks/bench_versions.py $(version_trees) --model 1.3b \
        --micro-batch 8 --seq 1024 --offload-param none --offload-optimizer cpu --sub-group-size 1e8 \
        --grad-accum 1 --rounds 2 --steps 3 --warmup 2 --run-timeout 100 --budget-s 120 \
        --out "$out/versions-1.3b-optimizer-cpu.json"
      ;;
  esac
}

if [[ $phase == all ]]; then
  for p in step step-more scale tests; do run_phase "$p"; done
else
  run_phase "$phase"
fi
echo "== logs in $out; $([[ $failed == 0 ]] && echo 'every step passed' || echo 'some step failed or was cut off: see phases.log')"
exit $failed
