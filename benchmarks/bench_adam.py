"""Fused CPU Adam: our kernel against torch, and against the bandwidth floor.

Two cases over the same buffers (so the same physical pages) in one run:

  fp32  ours: adam_step(p, g32, m, v)
        torch: torch._fused_adamw_ (what AdamW(fused=True).step() calls)
  bf16  ours: adam_step(p, g16, m, v, param_out=p16)            bf16 grads,
        torch: g32.copy_(g16); _fused_adamw_; p16.copy_(p)       bf16 param copy
              (the best torch pipeline: preallocated upcast buffer)

and for each case the bandwidth floor: the kernel's `touch` pass, which makes
exactly the step's loads and stores with no Adam arithmetic.

Contenders run alternately, round after round, with the order rotated each
round; a figure is the median over rounds, and a ratio the median of the
per-round ratios. The machine is shared: read ratios, not times.

    .venv/bin/python benchmarks/bench_adam.py [--numel 100000000] [--rounds 11]

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import infinity.kernels as kernels
from infinity.hardware import cpu_name
from infinity.kernels import extension

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
# Bytes each pass moves per element: reads p, g, m, v; writes p, m, v (+ copy).
BYTES_PER_ELEM = {"fp32": 4 + 4 + 4 + 4 + 3 * 4, "bf16": 4 + 2 + 4 + 4 + 3 * 4 + 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=100_000_000, help="parameters (default 100M)")
    ap.add_argument("--rounds", type=int, default=11, help="timed rounds after 2 warm-up rounds")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument(
        "--memory", choices=["torch", "huge"], default="torch",
        help="buffers from torch.empty (4 KiB pages), or from infinity.storage.aligned_empty "
        "(transparent huge pages, as the engine's host tier allocates them)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if kernels.backend() != "cpp":
        raise SystemExit(f"the C++ kernel is unavailable ({extension.KERNEL.error}); nothing to measure")

    n = args.numel
    if args.memory == "huge":
        from infinity.storage import aligned_empty as empty
    else:
        empty = torch.empty
    gen = torch.Generator().manual_seed(0)
    p, m, v, g32, g32_buf = (empty(n, dtype=torch.float32) for _ in range(5))
    g16, p16 = empty(n, dtype=torch.bfloat16), empty(n, dtype=torch.bfloat16)
    p.normal_(generator=gen)
    m.normal_(generator=gen).mul_(1e-2)
    v.uniform_(generator=gen).mul_(1e-4)
    g32.normal_(generator=gen)
    g16.copy_(g32)
    p16.zero_()
    g32_buf.zero_()  # torch pipeline's preallocated upcast buffer (touched: no first-use faults)
    step = [0]

    def ours_fp32():
        step[0] += 1
        kernels.adam_step(p, g32, m, v, step=step[0], **HYPER)

    def ours_bf16():
        step[0] += 1
        kernels.adam_step(p, g16, m, v, step=step[0], param_out=p16, **HYPER)

    def torch_fused(grad):
        step[0] += 1
        torch._fused_adamw_(
            [p], [grad], [m], [v], [], [torch.tensor(float(step[0]))],
            lr=HYPER["lr"], beta1=HYPER["beta1"], beta2=HYPER["beta2"],
            weight_decay=HYPER["weight_decay"], eps=HYPER["eps"], amsgrad=False, maximize=False,
        )  # fmt: skip

    def torch_fp32():
        torch_fused(g32)

    def torch_bf16():
        g32_buf.copy_(g16)
        torch_fused(g32_buf)
        p16.copy_(p)

    cases = {
        "fp32": {"ours": ours_fp32, "torch": torch_fp32, "floor": lambda: extension.touch(p, g32, m, v)},
        "bf16": {"ours": ours_bf16, "torch": torch_bf16, "floor": lambda: extension.touch(p, g16, m, v, p16)},
    }
    times = {case: {name: [] for name in fns} for case, fns in cases.items()}
    order = [(case, name) for case, fns in cases.items() for name in fns]
    for r in range(2 + args.rounds):
        rotated = order[r % len(order) :] + order[: r % len(order)]
        for case, name in rotated:
            start = time.perf_counter()
            cases[case][name]()
            elapsed = time.perf_counter() - start
            if r >= 2:
                times[case][name].append(elapsed)

    print(
        f"fused Adam, {n:,} params, {torch.get_num_threads()} threads, body {extension.best_isa()}, "
        f"{args.memory} memory, "
        f"torch {torch.__version__}, {cpu_name()}"
    )
    print(f"{'case':5} {'contender':8} {'median ms':>10} {'Gparam/s':>9} {'GB/s':>7}")
    result = {
        "numel": n, "threads": torch.get_num_threads(), "rounds": args.rounds, "isa": extension.best_isa(),
        "memory": args.memory,
    }  # fmt: skip
    for case, by_name in times.items():
        for name, ts in by_name.items():
            med = statistics.median(ts)
            gbps = n * BYTES_PER_ELEM[case] / med / 1e9
            print(f"{case:5} {name:8} {med * 1e3:10.1f} {n / med / 1e9:9.3f} {gbps:7.1f}")
            result[f"{case}_{name}_ms"] = round(med * 1e3, 2)
            result[f"{case}_{name}_gparams_s"] = round(n / med / 1e9, 3)
        speedups = [t / o for t, o in zip(by_name["torch"], by_name["ours"])]
        over_floor = [o / f for o, f in zip(by_name["ours"], by_name["floor"])]
        result[f"{case}_speedup_vs_torch"] = round(statistics.median(speedups), 3)
        result[f"{case}_speedup_vs_torch_iqr"] = [round(q, 3) for q in quartiles(speedups)]
        result[f"{case}_ours_over_floor"] = round(statistics.median(over_floor), 3)
        result[f"{case}_ours_over_floor_iqr"] = [round(q, 3) for q in quartiles(over_floor)]
    for case, against, need in (("fp32", "torch fused AdamW", 1.0), ("bf16", "the torch pipeline", 1.3)):
        lo, hi = result[f"{case}_speedup_vs_torch_iqr"]
        flo, fhi = result[f"{case}_ours_over_floor_iqr"]
        print(
            f"{case}: ours {result[f'{case}_speedup_vs_torch']:.2f}x {against} (IQR {lo:.2f}-{hi:.2f}; "
            f"need >= {need}), {result[f'{case}_ours_over_floor']:.2f}x the floor's time "
            f"(IQR {flo:.2f}-{fhi:.2f}; need <= 1.25)"
        )
    print(json.dumps(result))


def quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


if __name__ == "__main__":
    main()
