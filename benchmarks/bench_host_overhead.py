"""The engine's host-side work a step, against plain PyTorch on the same model.

A small model on a GPU waits for the thread that feeds it: every parameter the
engine manages costs Python on that thread (the module hooks, each fetch and
release, the prefetcher, each copy's issue, the gradient's hook). This
benchmark takes a GPT with a real model's parameter tensors and modules but
next to no compute (124M's twelve layers at width 64, fp32, a few tokens), so
a step's time over plain PyTorch's is that host-side work. Plain PyTorch and
the engine alternate round by round in one process; each row gives both steps
(medians), their ratio, and the difference per managed parameter tensor.

Without a GPU the device is kept distinct from host memory
(``INFINITY_DISTINCT_DEVICE=1``, a worker thread playing the copy stream), so
every crossing a GPU run issues is issued; ``--one-memory`` runs the CPU path.

    python benchmarks/bench_host_overhead.py                  # none and cpu, 12 layers
    python benchmarks/bench_host_overhead.py --layers 24 --cases cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from infinity.commands.host_feed import CASES, EngineSteps, PlainSteps, batches_for, thin_gpt, timed_block  # noqa: E402
from infinity.models.gpt import GPTConfig  # noqa: E402
from infinity.runtime.hardware import cpu_name  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--cases", default="none,cpu", help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--block", type=int, default=10, help="steps a round, back to back")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--one-memory", action="store_true", help="without a GPU: the CPU path, nothing crosses")
    p.add_argument("--out", default=None, help="also write the JSON line to this file")
    return p.parse_args(argv)


def model_config(args):
    return thin_gpt(args.layers, args.width, args.seq)


def run_case(case: str, cfg: GPTConfig, args, device: torch.device) -> dict:
    plain, ours = PlainSteps(cfg, device), EngineSteps(cfg, case, device)
    managed = ours.tensors
    g = torch.Generator().manual_seed(0)
    plain_s, ours_s, ratios, hooks_s = [], [], [], []
    try:
        for round_ in range(args.warmup + args.rounds):
            batches = batches_for(cfg, device, args.block, micro_batch=args.micro_batch, generator=g)
            p, o = timed_block(device, plain, batches), timed_block(device, ours, batches)
            if round_ >= args.warmup:
                plain_s.append(p)
                ours_s.append(o)
                ratios.append(o / p)
                hooks_s.append(ours.engine.step_metrics()["hooks_s"])  # the block's last step
    finally:
        ours.close()
        plain.close()
    row = {"case": case, "param_tensors": managed, "plain_step_s": statistics.median(plain_s),
           "step_s": statistics.median(ours_s), "ratio": statistics.median(ratios)}
    row["over_plain_ms"] = (row["step_s"] - row["plain_step_s"]) * 1e3
    row["over_plain_us_per_param"] = row["over_plain_ms"] * 1e3 / managed
    row["hooks_ms"] = statistics.median(hooks_s) * 1e3  # step_metrics()["hooks_s"]: the engine's hooks alone
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.one_memory:
        os.environ["INFINITY_DISTINCT_DEVICE"] = "1"  # read as each engine decides its placement
    if device.type == "cpu":
        torch.set_num_threads(1)  # the host-side work is one thread's; the other core plays the copy stream
    cfg = model_config(args)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        "CPU, one memory" if args.one_memory else "CPU, device memory kept distinct")
    print(f"machine: {cpu_name()}; {where}; GPT {args.layers} layers x width {args.width}, fp32, "
          f"micro-batch {args.micro_batch} x seq {args.seq}, {args.rounds} rounds of {args.block} steps")
    print(f"{'case':>6} {'tensors':>8} {'plain ms':>9} {'ours ms':>8} {'ratio':>7} {'over ms':>8} {'us/tensor':>10} "
          f"{'hooks ms':>9}")
    rows = []
    for case in args.cases.split(","):
        row = run_case(case, cfg, args, device)
        rows.append(row)
        print(f"{case:>6} {row['param_tensors']:>8} {row['plain_step_s'] * 1e3:>9.2f} {row['step_s'] * 1e3:>8.2f} "
              f"{row['ratio']:>6.2f}x {row['over_plain_ms']:>8.2f} {row['over_plain_us_per_param']:>10.1f} "
              f"{row['hooks_ms']:>9.2f}")
    line = json.dumps({"machine": cpu_name(), "device": where, "layers": args.layers, "width": args.width,
                       "rows": rows})
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
