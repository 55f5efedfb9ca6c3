"""Fused CPU Adam: our kernel against torch, and against the bandwidth floor.

Two cases over the same buffers (so the same physical pages) in one run:

  fp32  ours: adam_step(p, g32, m, v)
        torch: torch._fused_adamw_ (what AdamW(fused=True).step() calls)
  bf16  ours: adam_step(p, g16, m, v, param_out=p16)            bf16 grads,
        torch: g32.copy_(g16); _fused_adamw_; p16.copy_(p)       bf16 param copy
              (the best torch pipeline: preallocated upcast buffer)

and for each case the bandwidth floor: the kernel's `touch` pass, which makes
exactly the step's loads and stores with no Adam arithmetic.

Two more cases, the compact optimizer states (kernels/compact.py), bf16 grads
and a bf16 parameter copy:

  bf16s ours: adam_step_compact(state_dtype="bf16")   master, moments bf16
  int8s ours: adam_step_compact(state_dtype="int8")   master bf16, moments 8-bit + scales
        fp32: the bf16 case's adam_step (fp32 states), for the time per step
        floor: extension.touch_compact, the same loads and stores as ours

Contenders run alternately, round after round, with the order rotated each
round; a figure is the median over rounds, and a ratio the median of the
per-round ratios. The machine is shared: read ratios, not times.

    .venv/bin/python benchmarks/bench_adam.py [--numel 100000000] [--rounds 11] [--cases fp32,bf16,bf16s,int8s]
                                              [--compare-body avx2]

--compare-body BODY adds one more contender to the compact cases, our kernel's
body BODY (the best body this CPU runs is "ours"): what a newer body gains.

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import infinity.kernels as kernels
from infinity.runtime.hardware import cpu_name
from infinity.kernels import compact, extension
from infinity.kernels.constants import AdamConstants

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
# Bytes each pass moves per element: reads p, g, m, v; writes p, m, v (+ copy).
# Compact: bf16s reads master, g, m, v (2 B each) and writes master, m, v and the copy;
# int8s the same with 1-byte moments, plus two fp32 scales per 256 elements read and written.
BYTES_PER_ELEM = {
    "fp32": 4 + 4 + 4 + 4 + 3 * 4, "bf16": 4 + 2 + 4 + 4 + 3 * 4 + 2,
    "bf16s": 4 * 2 + 4 * 2, "int8s": 2 * (2 + 2 + 1 + 1) + 2 * 2 * 8 / 256,
}  # fmt: skip
COMPACT_CASES = {"bf16s": "bf16", "int8s": "int8"}


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
    ap.add_argument("--cases", default="fp32,bf16,bf16s,int8s", help="comma-separated cases to run")
    ap.add_argument(
        "--compare-body", choices=["generic", "avx2", "avx512"], default=None,
        help="compact cases: also run the kernel's body BODY (contender 'body') beside the best one, "
        "to measure what a body gains",
    )  # fmt: skip
    args = ap.parse_args()
    wanted = args.cases.split(",")
    unknown = set(wanted) - set(BYTES_PER_ELEM)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; choose from {sorted(BYTES_PER_ELEM)}")
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
    for case, state_dtype in COMPACT_CASES.items():
        if case in wanted:
            cases[case] = compact_contenders(state_dtype, n, empty, p, m, v, g16, p16, ours_bf16, args.compare_body)
    cases = {case: fns for case, fns in cases.items() if case in wanted}
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
        against = "fp32" if case in COMPACT_CASES else "torch"
        speedups = [t / o for t, o in zip(by_name[against], by_name["ours"])]
        over_floor = [o / f for o, f in zip(by_name["ours"], by_name["floor"])]
        result[f"{case}_speedup_vs_torch"] = round(statistics.median(speedups), 3)
        result[f"{case}_speedup_vs_torch_iqr"] = [round(q, 3) for q in quartiles(speedups)]
        result[f"{case}_ours_over_floor"] = round(statistics.median(over_floor), 3)
        result[f"{case}_ours_over_floor_iqr"] = [round(q, 3) for q in quartiles(over_floor)]
        if "body" in by_name:
            gains = [b / o for b, o in zip(by_name["body"], by_name["ours"])]
            result[f"{case}_speedup_vs_body"] = round(statistics.median(gains), 3)
            result[f"{case}_speedup_vs_body_iqr"] = [round(q, 3) for q in quartiles(gains)]
    for case, against, need in (("fp32", "torch fused AdamW", 1.0), ("bf16", "the torch pipeline", 1.3)):
        if case not in times:
            continue
        lo, hi = result[f"{case}_speedup_vs_torch_iqr"]
        flo, fhi = result[f"{case}_ours_over_floor_iqr"]
        print(
            f"{case}: ours {result[f'{case}_speedup_vs_torch']:.2f}x {against} (IQR {lo:.2f}-{hi:.2f}; "
            f"need >= {need}), {result[f'{case}_ours_over_floor']:.2f}x the floor's time "
            f"(IQR {flo:.2f}-{fhi:.2f}; need <= 1.25)"
        )
    for case in COMPACT_CASES:
        if case not in times:
            continue
        lo, hi = result[f"{case}_speedup_vs_torch_iqr"]
        flo, fhi = result[f"{case}_ours_over_floor_iqr"]
        print(
            f"{case}: ours {result[f'{case}_speedup_vs_torch']:.2f}x as fast as the fp32-state step "
            f"(IQR {lo:.2f}-{hi:.2f}), {result[f'{case}_ours_over_floor']:.2f}x the floor's time "
            f"(IQR {flo:.2f}-{fhi:.2f}; the floor moves {BYTES_PER_ELEM[case]:.2f} B/param, fp32 states 30)"
        )
        if f"{case}_speedup_vs_body" in result:
            blo, bhi = result[f"{case}_speedup_vs_body_iqr"]
            print(
                f"{case}: the {extension.best_isa()} body {result[f'{case}_speedup_vs_body']:.2f}x as fast as "
                f"the {args.compare_body} body (IQR {blo:.2f}-{bhi:.2f})"
            )
    print(json.dumps(result))


def compact_contenders(state_dtype, n, empty, p, m, v, g16, p16, ours_fp32_states, compare_body):
    """ours, fp32 (the fp32-state step with bf16 grads and copy), floor and, given
    `compare_body`, that body of our kernel ("body"), for one compact state dtype."""
    state = {}
    for spec in compact.state_layout(state_dtype, n):
        state[spec.name] = empty(spec.numel, dtype=spec.dtype)
    # From the fp32 states, in chunks (the conversion's temporaries are then small).
    chunk = 1 << 22
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        part = compact.from_fp32(state_dtype, p[lo:hi], m[lo:hi], v[lo:hi])
        blo, bhi = lo // compact.BLOCK_NUMEL, compact.num_blocks(hi)
        for name, t in part.items():
            if name.endswith("_scale"):
                state[name][blo:bhi].copy_(t)
            else:
                state[name][lo:hi].copy_(t)
    scales = {k: state[k] for k in ("exp_avg_scale", "exp_avg_sq_scale") if k in state}
    step = [0]

    def ours():
        step[0] += 1
        kernels.adam_step_compact(
            state["master"], g16, state["exp_avg"], state["exp_avg_sq"], state_dtype=state_dtype,
            step=step[0], seed=1, param_out=p16, **scales, **HYPER,
        )  # fmt: skip

    def floor():
        extension.touch_compact(
            state_dtype, state["master"], g16, state["exp_avg"], state["exp_avg_sq"],
            scales.get("exp_avg_scale"), scales.get("exp_avg_sq_scale"), p16,
        )  # fmt: skip

    contenders = {"ours": ours, "fp32": ours_fp32_states, "floor": floor}
    if compare_body:
        keys = compact.step_keys(1, 1)  # any keys: the bodies cost the same whatever the bits

        def body():
            c = AdamConstants.for_step(step=step[0] + 1, adamw=True, bias_correction=True, **HYPER)
            extension.adam_update_compact(
                c, state_dtype, keys, state["master"], g16, state["exp_avg"], state["exp_avg_sq"],
                scales.get("exp_avg_scale"), scales.get("exp_avg_sq_scale"), p16, isa=compare_body,
            )  # fmt: skip

        contenders["body"] = body
    return contenders


def quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


if __name__ == "__main__":
    main()
