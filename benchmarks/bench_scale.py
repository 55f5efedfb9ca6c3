"""Scale under a host-memory budget: the largest GPTs this machine trains with
parameters and optimizer on NVMe, each run's peak RSS against its budget, the
NVMe bytes one step moves and the seconds it takes.

Each preset runs `infinity train` in its own process (so its peak RSS is its
own), with params and optimizer on NVMe under `--host-memory`, and the JSON
summary is read back. A preset passes when it trains its steps with a finite,
falling loss and a peak RSS within `--max-rss`.

    python benchmarks/bench_scale.py --presets 2.7b --host-memory 7GiB --max-rss 8GiB --nvme-path /mnt/nvme
    python benchmarks/bench_scale.py --presets 125m,350m --steps 2       # a quick look

Swap files go under --nvme-path (default: a temporary folder), removed after each run. A preset whose NVMe
share under the budget (from `infinity estimate`: what does not fit in --host-memory) exceeds the free space
there is skipped, and says so.

    # a GPU machine (125 GiB host, 64 GiB disk): the states that fit stay in host memory
    python benchmarks/bench_scale.py --presets 6.7b --host-memory 100GiB --max-rss 120GiB
    python benchmarks/bench_scale.py --presets 13b --optimizer-state-dtype int8 --host-memory 100GiB --max-rss 120GiB
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from infinity.placement.estimate import estimate_gpt
from infinity.placement.host_budget import resolve_host_budget
from infinity.config.units import parse_host_memory
from infinity.models.gpt import get_preset


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="2.7b", help="comma-separated presets, smallest first")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--lr", default=None, help="peak learning rate (default: the preset's; a few steps from scratch "
                                              "want less: Adam's first step moves every weight by about lr)")
    p.add_argument("--optimizer-state-dtype", default="fp32", choices=("fp32", "bf16", "int8"),
                   help="form of master and moments (issue 13: bf16 6 B, int8 ~4 B an element instead of 12)")
    p.add_argument("--host-memory", default="7GiB", help="the engine's host-memory budget per run")
    p.add_argument("--max-rss", default="8GiB", help="the peak RSS a run must stay within")
    p.add_argument("--nvme-path", default=None)
    p.add_argument("--out", default=None, help="also write the JSON line to this file")
    return p.parse_args(argv)


def nvme_share(preset: str, args) -> int:
    """The bytes a run of ``preset`` puts on NVMe under the host-memory budget (``infinity estimate``'s plan)."""
    budget = resolve_host_budget(parse_host_memory(args.host_memory, key="--host-memory"))
    planned = estimate_gpt(get_preset(preset), micro_batch=args.micro_batch, seq_len=args.seq_len,
                           precision=args.precision, offload_param="nvme", offload_optimizer="nvme",
                           gpu=torch.cuda.is_available(), state_dtype=args.optimizer_state_dtype,
                           host_memory_budget=budget)
    return planned["totals"]["nvme"]


def run_preset(preset: str, args, nvme_root: str) -> dict:
    nvme = tempfile.mkdtemp(prefix=f"scale-{preset}-", dir=nvme_root)
    needed = nvme_share(preset, args)
    free = shutil.disk_usage(nvme).free
    if needed > free:
        shutil.rmtree(nvme, ignore_errors=True)
        return {"preset": preset, "skipped": f"needs ~{needed / 1e9:.0f} GB on NVMe, {free / 1e9:.0f} GB free"}
    cmd = [sys.executable, "-m", "infinity.cli", "train", "--preset", preset, "--steps", str(args.steps),
           "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--precision", args.precision,
           "--offload-param", "nvme", "--offload-optimizer", "nvme", "--nvme-path", nvme,
           "--host-memory", args.host_memory, "--optimizer-state-dtype", args.optimizer_state_dtype,
           "--json"] + (["--lr", args.lr] if args.lr else [])
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    wall = time.perf_counter() - start
    if out.returncode != 0:
        return {"preset": preset, "failed": out.stderr.strip().splitlines()[-1:] or [f"exit {out.returncode}"]}
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    losses = summary["losses"]
    nvme_tier = summary["tiers"]["nvme"]
    return {
        "preset": preset, "params": summary["num_params"], "steps": len(losses), "losses": losses,
        "loss_finite_and_falling": all(math.isfinite(x) for x in losses) and losses[-1] < losses[0],
        "peak_rss_bytes": summary["peak_rss_bytes"], "host_peak_nbytes": summary["tiers"]["host"]["peak_nbytes"],
        "nvme_bytes_per_step": (nvme_tier["bytes_read"] + nvme_tier["bytes_written"]) / max(1, len(losses)),
        "s_per_step": summary["train_s"] / max(1, len(losses)), "wall_s": wall,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    max_rss = parse_host_memory(args.max_rss, key="--max-rss")
    nvme_root = args.nvme_path or tempfile.gettempdir()
    rows = []
    print(f"{'preset':>7} {'params':>14} {'peak RSS':>10} {'NVMe GB/step':>13} {'s/step':>8}  loss")
    for preset in [p.strip() for p in args.presets.split(",")]:
        row = run_preset(preset, args, nvme_root)
        rows.append(row)
        if "losses" not in row:
            print(f"{preset:>7}  {row.get('skipped') or row.get('failed')}", flush=True)
            continue
        row["within_max_rss"] = row["peak_rss_bytes"] <= max_rss
        print(f"{preset:>7} {row['params']:>14,} {row['peak_rss_bytes'] / 2**30:8.2f} GiB "
              f"{row['nvme_bytes_per_step'] / 1e9:13.1f} {row['s_per_step']:8.1f}  "
              f"{row['losses'][0]:.3f} -> {row['losses'][-1]:.3f}", flush=True)
    line = json.dumps({"host_memory": args.host_memory, "max_rss": args.max_rss, "rows": rows})
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    print(line)
    return 0 if all(r.get("within_max_rss") and r.get("loss_finite_and_falling") for r in rows if "losses" in r) else 1


if __name__ == "__main__":
    sys.exit(main())
