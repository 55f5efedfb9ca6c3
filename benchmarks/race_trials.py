"""Race trials (issue 17): the two-rank parity case of tests/distributed/test_parity.py, with the optimizer on NVMe
and the parameters on each tier, for both models, run for N rounds while a busy process spins on every core. Any
ordering in the NVMe optimizer path that depends on timing shows up as losses or weights that differ from plain
PyTorch; the expected count of mismatches is 0.

    python benchmarks/race_trials.py                   # 5 rounds, a hog per core
    python benchmarks/race_trials.py --rounds 20 --hogs 0 --json

Prints a line per round (mismatches, seconds) and ends with the total and the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "distributed"))

TIERS = ("none", "cpu", "nvme")


def _hog(stop) -> None:
    """A busy loop: one core's worth of contention until ``stop`` is set."""
    x = 0
    while not stop.is_set():
        for _ in range(10_000):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def _run(rank: int, world_size: int):
    """Every rank's (losses, gathered state) for each model x parameter tier, the optimizer on NVMe."""
    import test_parity as parity
    from helpers import engine_config, engine_train

    results = {}
    for name, (model, batches) in parity._models().items():
        for param in TIERS:
            with tempfile.TemporaryDirectory() as nvme:
                config = engine_config(param=param, optimizer="nvme", nvme_path=nvme, accum=parity.ACCUM,
                                       clip=parity.CLIP, lr=parity.LR, precision="fp32")
                losses, state, _ = engine_train(model, config, batches, steps=parity.STEPS, accum=parity.ACCUM,
                                                rank=rank, world_size=world_size)
            results[(name, param, "nvme")] = (losses, state)
    return results


def _mismatches(results, references) -> list[str]:
    """The cases whose losses or weights differ from the reference beyond test_parity's tolerance."""
    import torch

    bad = []
    for (name, param, optimizer), (losses, state) in results.items():
        ref_losses, ref_state = references[name]
        where = f"{name} params={param} optimizer={optimizer}"
        try:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
            for key, ref in ref_state.items():
                torch.testing.assert_close(state[key], ref, rtol=1e-5, atol=1e-6)
        except AssertionError as err:
            bad.append(f"{where}: {str(err).splitlines()[0]}")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="rounds of the parity case (default 5)")
    p.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="busy processes (default: one per core)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.hogs < 0:
        p.error("--rounds must be at least 1 and --hogs at least 0")

    import test_parity as parity
    from helpers import reference_train, run_ranks

    from infinity.runtime.hardware import machine_description

    references = {name: reference_train(model, batches, steps=parity.STEPS, accum=parity.ACCUM, clip=parity.CLIP,
                                        lr=parity.LR) for name, (model, batches) in parity._models().items()}
    stop = mp.Event()
    hogs = [mp.Process(target=_hog, args=(stop,), daemon=True) for _ in range(args.hogs)]
    for h in hogs:
        h.start()
    rounds = []
    try:
        for i in range(args.rounds):
            t0 = time.perf_counter()
            results = run_ranks(_run, world_size=2)
            bad = _mismatches(results[0], references) + [f"rank 1: {b}" for b in _mismatches(results[1], references)]
            rounds.append({"round": i + 1, "mismatches": bad, "seconds": time.perf_counter() - t0})
            print(f"round {i + 1}/{args.rounds}: {len(bad)} mismatch(es) in {2 * len(TIERS)} cases x 2 ranks, "
                  f"{rounds[-1]['seconds']:.0f} s" + "".join(f"\n  {b}" for b in bad), flush=True)
    finally:
        stop.set()
        for h in hogs:
            h.join(timeout=5)
    total = sum(len(r["mismatches"]) for r in rounds)
    machine = machine_description()
    print(f"race trials: {total} mismatch(es) in {args.rounds} round(s) under {args.hogs} busy process(es); {machine}")
    if args.json:
        print(json.dumps({"rounds": rounds, "mismatches": total, "hogs": args.hogs, "machine": machine}))
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
