"""The squared gradient norm in fp64 (infinity/grads/norm.py) against torch's one-liner.

Every step computes the norm of every sub-group's gradients (clipping, the fp16 overflow check, the metrics).
Two contenders over the same host gradients, alternating, one sub-group of ``--numel`` elements at a time:

  ours:  grad_norm.sq_norm_fp64(g)                  chunks through one 1 MiB fp64 buffer
  torch: sum(c.double().pow(2).sum() for c in g.split(2**24))   (what the engine did before)

Both are exact to fp64 rounding; the bench checks they agree to 1e-12. torch's widens each chunk into fresh
fp64 tensors (16 bytes a gradient), which large blocks take from fresh pages the kernel zeroes.

    .venv/bin/python benchmarks/bench_grad_norm.py [--numel 20000000] [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from infinity.grads.norm import sq_norm_fp64  # noqa: E402
from infinity.runtime.hardware import machine_description  # noqa: E402


def torch_sq_norm(values: torch.Tensor) -> float:
    return float(sum(chunk.double().pow(2).sum() for chunk in values.split(1 << 24)))


def timed(fn, values: torch.Tensor) -> tuple[float, float]:
    start = time.perf_counter()
    result = fn(values)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=20_000_000, help="gradients per sub-group (the default size)")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    grads = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    contenders = {"ours": sq_norm_fp64, "torch": torch_sq_norm}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    results = {}
    for i in range(args.rounds + 1):
        order = list(contenders) if i % 2 == 0 else list(reversed(contenders))
        for name in order:
            elapsed, results[name] = timed(contenders[name], grads)
            if i > 0:  # round 0 warms up
                times[name].append(elapsed)
    agree = abs(results["ours"] - results["torch"]) <= 1e-12 * abs(results["torch"])
    ratio = statistics.median(t / o for o, t in zip(times["ours"], times["torch"]))
    print(f"machine: {machine_description()}; {torch.get_num_threads()} threads")
    print(f"squared norm of {args.numel:,} fp32 gradients: ours {statistics.median(times['ours']) * 1e3:.1f} ms, "
          f"torch {statistics.median(times['torch']) * 1e3:.1f} ms; ours {ratio:.1f}x as fast (median of per-round "
          f"ratios); results agree to 1e-12: {agree}")
    print(json.dumps({"numel": args.numel, "rounds": args.rounds, "ours_ms": statistics.median(times["ours"]) * 1e3,
                      "torch_ms": statistics.median(times["torch"]) * 1e3, "speedup": ratio, "agree": agree}))
    if not agree:
        sys.exit(f"the two norms differ: {results}")


if __name__ == "__main__":
    main()
