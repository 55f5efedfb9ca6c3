"""Kill -9 trials, many more than the test suite runs: a training run (TinyGPT, fp32, parameters and
optimizer on NVMe, a checkpoint every 2 steps) is killed at random moments — in a step, in a save, in
its start or resume — and resumed each time; at the end its losses and weights must equal an
uninterrupted run's bit for bit, and after every kill `latest` must name the newest complete checkpoint.

    python benchmarks/fault_trials.py                  # 50 kills in rounds of 10, in a temporary folder
    python benchmarks/fault_trials.py --kills 200 --per-round 20 --seed 3 --dir /mnt/nvme/trials

Prints one line per kill, one per round, and a final JSON line with the pass count.
The trial machinery is the test suite's (tests/unit/test_checkpoint_faults.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "unit")]

import test_checkpoint_faults as faults  # noqa: E402  (after the path above)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=50, help="kills in all (default 50)")
    p.add_argument("--per-round", type=int, default=10, help="kills per training run to the end (default 10)")
    p.add_argument("--steps", type=int, default=faults.STEPS, help=f"steps per run (default {faults.STEPS})")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments (default 0)")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed after)")
    p.add_argument("-q", "--quiet", action="store_true", help="no line per kill")
    args = p.parse_args()
    if args.kills < 1 or args.per_round < 1:
        p.error("--kills and --per-round must be at least 1")

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="fault-trials-"))
    ctx = faults.forkserver()
    say = (lambda *a: None) if args.quiet else (lambda line: print("  " + line, flush=True))
    passed, failed, where = 0, 0, {}
    started = time.perf_counter()
    rounds = (args.kills + args.per_round - 1) // args.per_round
    try:
        for r in range(rounds):
            kills = min(args.per_round, args.kills - r * args.per_round)
            workdir = root / f"round{r}"
            t0 = time.perf_counter()
            try:
                outcome = faults.kill_trials(workdir, kills=kills, seed=args.seed * 1000 + r, steps=args.steps,
                                             ctx=ctx, say=say)
            except AssertionError as err:
                failed += kills
                print(f"round {r}: FAILED ({kills} kills): {err}", flush=True)
                continue
            passed += kills
            for k, v in outcome["where"].items():
                where[k] = where.get(k, 0) + v
            print(f"round {r}: {kills} kills, resumed bitwise ({outcome['where']}) in {time.perf_counter() - t0:.1f} s",
                  flush=True)
            shutil.rmtree(workdir, ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"kills": args.kills, "passed": passed, "failed": failed, "killed_in": where,
                      "seconds": round(time.perf_counter() - started, 1)}))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
