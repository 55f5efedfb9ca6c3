#!/usr/bin/env bash
# Old versions of the engine as source trees under .versions/ (ignored by git), for benchmarks/bench_versions.py:
# each is `git archive COMMIT infinity kernels storage pyproject.toml` unpacked into .versions/COMMIT, with a COMMIT
# file saying which commit it is. About 0.5-1.3 MB each, so they travel to a GPU machine with the working tree when
# `.versions` is named in the device tool's carry list (64 MiB in all).
#
#   bash benchmarks/versions.sh                  # the default commits below
#   bash benchmarks/versions.sh 36b5366 f6ac807  # any commits
#
# The default commits, for "has the offloaded GPU step slowed, or do the hosts differ" (1.3B GPT, parameters and
# optimizer states on the CPU, accumulation 1, bf16):
#
#   ade920c  the earliest commit whose GPU path is complete. db1e57b built the GPU path (one placement, the copy
#            module with its stream and events, gradients routed off the backward hook, pinned crossing buffers);
#            pinning moved behind initialize in 84abf27; the overlapped step (410fe1d) and its read-ahead came
#            earlier still. ade920c fixed what the GPU path's first tree got wrong on CUDA alone: a host scratch of
#            new compute shards reused before its copy up had landed (optimizer on the CPU, compute shards on the
#            GPU: the next step's kernel could overwrite shards still crossing) and the last copy noted outside the issuing lock. Before
#            it, db1e57b's cpu-optimizer step on a GPU can compute wrong values, so its time would not be that of
#            a correct step.
#   f6ac807  the commit whose H200 figures gave 11.75x plain PyTorch (its engine is ce4926d's: f6ac807 changed
#            RESULTS and README only).
#   36b5366  the engine just before the GPU path (db1e57b's parent): what the first H100 measurement most likely ran
#            (0.45-0.63 s a step with accumulation 1; the commits after it name that run's failures: a synchronous
#            copy per parameter with accumulation, device memory handed to the CPU kernel). Pinned memory there is
#            opt-in (pin_memory: true, which bench_versions.py sets on a GPU). Not a complete GPU path: compare
#            it for the history, not as a correct baseline.
#
# The working tree itself is the third version: `--tree head=.`.
set -euo pipefail
cd "$(dirname "$0")/.."
if (($# == 0)); then set -- ade920c f6ac807 36b5366; fi
if ! git check-ignore -q .versions/x; then
  echo "versions.sh: .versions/ is not ignored by git here (it is in .gitignore from this commit on)" >&2
  exit 1
fi
mkdir -p .versions
for commit in "$@"; do
  full=$(git rev-parse --verify "$commit^{commit}")
  name=$(git rev-parse --short=7 "$full")
  rm -rf ".versions/$name"
  mkdir -p ".versions/$name"
  git archive "$full" infinity kernels storage pyproject.toml | tar -x -C ".versions/$name"
  git log -1 --format='%h %cs %s' "$full" | cut -c1-160 > ".versions/$name/COMMIT"
  echo "$name: $(du -sh ".versions/$name" | cut -f1)  $(cat ".versions/$name/COMMIT")"
done
echo "all of .versions: $(du -sh .versions | cut -f1)"
