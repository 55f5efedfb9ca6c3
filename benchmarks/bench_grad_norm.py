"""The squared gradient norm in fp64 (infinity/grads/norm.py) against torch's one-liner.

Every step computes the norm of every sub-group's gradients (clipping, the fp16 overflow check, the metrics).
Two contenders over the same host gradients, alternating, one sub-group of ``--numel`` elements at a time:

  ours:  grad_norm.sq_norm_fp64(g)                  chunks through one 1 MiB fp64 buffer
  torch: sum(c.double().pow(2).sum() for c in g.split(2**24))   (what the engine did before)

Both are exact to fp64 rounding; the bench checks they agree to 1e-12. torch's widens each chunk into fresh
fp64 tensors (16 bytes a gradient), which large blocks take from fresh pages the kernel zeroes.

``--in-update``: the norm where the overlapped step takes it, inside a sub-group's host update. Two contenders
over the same states and gradients, alternating, for fp32 and int8 states and bf16 and fp32 gradients:

  apart:  kernels.sq_norm_fp64(g), then the fused Adam     (a pass of its own over the gradients)
  fused:  the fused Adam with grad_sq_norm=True            (each block summed just before the update reads it)

The bench checks that both give the same bits (norm and states).

    .venv/bin/python benchmarks/bench_grad_norm.py [--numel 20000000] [--rounds 9]
    .venv/bin/python benchmarks/bench_grad_norm.py --in-update [--numel 67108864] [--rounds 7]
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

from infinity import kernels  # noqa: E402
from infinity.grads.norm import sq_norm_fp64  # noqa: E402
from infinity.runtime.hardware import machine_description  # noqa: E402


def torch_sq_norm(values: torch.Tensor) -> float:
    return float(sum(chunk.double().pow(2).sum() for chunk in values.split(1 << 24)))


def timed(fn, values: torch.Tensor) -> tuple[float, float]:
    start = time.perf_counter()
    result = fn(values)
    return time.perf_counter() - start, result


def in_update(numel: int, rounds: int) -> None:
    """The host update with its norm apart and fused, alternating; ratios fused / apart."""
    if kernels.backend() != "cpp":
        sys.exit("--in-update needs the C++ kernel (INFINITY_KERNELS is torch, or it did not build)")
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, seed=0)
    print(f"machine: {machine_description()}; {torch.get_num_threads()} threads; {numel:,} elements a sub-group")
    rows = []
    for state_dtype in ("fp32", "int8"):
        for grad_dtype in (torch.bfloat16, torch.float32):
            grads = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(grad_dtype)
            master = torch.linspace(-1.0, 1.0, numel)
            runs = {}
            for name in ("apart", "fused"):
                states = (dict(master=master.clone(), exp_avg=torch.zeros(numel), exp_avg_sq=torch.zeros(numel))
                          if state_dtype == "fp32" else
                          kernels.compact.from_fp32(state_dtype, master, torch.zeros(numel), torch.zeros(numel)))
                runs[name] = (states, torch.empty(numel, dtype=torch.bfloat16), [0], [])

            def update(name: str) -> float:
                states, out, step, norms = runs[name]
                step[0] += 1
                start = time.perf_counter()
                norm = kernels.sq_norm_fp64(grads) if name == "apart" else None
                fused = kernels.adam_step_compact(
                    states["master"], grads, states["exp_avg"], states["exp_avg_sq"], state_dtype=state_dtype,
                    step=step[0], exp_avg_scale=states.get("exp_avg_scale"),
                    exp_avg_sq_scale=states.get("exp_avg_sq_scale"), param_out=out, grad_sq_norm=name == "fused",
                    **hyper)
                norms.append(norm if name == "apart" else fused)
                return time.perf_counter() - start

            times: dict[str, list[float]] = {"apart": [], "fused": []}
            for i in range(rounds + 1):
                for name in (("apart", "fused") if i % 2 == 0 else ("fused", "apart")):
                    elapsed = update(name)
                    if i > 0:  # round 0 warms up
                        times[name].append(elapsed)
            same = runs["apart"][3] == runs["fused"][3] and all(
                torch.equal(t, runs["fused"][0][k]) for k, t in runs["apart"][0].items())
            ratio = statistics.median(f / a for a, f in zip(times["apart"], times["fused"]))
            row = {"state_dtype": state_dtype, "grad_dtype": str(grad_dtype).removeprefix("torch."),
                   "apart_ms": statistics.median(times["apart"]) * 1e3,
                   "fused_ms": statistics.median(times["fused"]) * 1e3, "fused_over_apart": ratio, "same_bits": same}
            rows.append(row)
            print(f"{state_dtype} states, {row['grad_dtype']} gradients: apart {row['apart_ms']:.1f} ms, fused "
                  f"{row['fused_ms']:.1f} ms; fused / apart {ratio:.3f} (median of per-round ratios); "
                  f"same bits: {same}")
    print(json.dumps({"numel": numel, "rounds": rounds, "in_update": rows}))
    if not all(row["same_bits"] for row in rows):
        sys.exit("the fused norm or update differs from the norm taken apart")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=None,
                        help="gradients per sub-group (default 20,000,000; with --in-update 2^26, beyond the cache)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 9; with --in-update 7)")
    parser.add_argument("--in-update", action="store_true", help="the norm inside the host update: apart and fused")
    args = parser.parse_args()
    if args.in_update:
        in_update(args.numel or 1 << 26, args.rounds or 7)
        return
    args.numel = args.numel or 20_000_000
    args.rounds = args.rounds or 9
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
