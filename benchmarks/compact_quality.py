"""Issue 13's quality check through the engine: ``infinity train`` on a preset with
each optimizer state dtype, same seed, same data, same schedule; reports each
run's final loss (and the mean of its last 20 steps) against fp32 states.

    .venv/bin/python benchmarks/compact_quality.py [--preset 50m] [--steps 300] [--micro-batch 2]
        [--seq-len 128] [--state-dtypes fp32,bf16,int8] [--offload cpu] [--eval-batches 64]

The runs are sequential (one CPU-heavy process at a time). Where master and
moments rest does not change the numbers (tests/unit/test_compact_states.py:
NVMe and host memory give the same bits), so ``--offload cpu`` (the default)
keeps the disk out of a run that measures quality. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


BOUNDS = {"bf16": 0.01, "int8": 0.02}
"""Issue 13's bounds on the loss against fp32 states, checked on the held-out loss."""


def run(state_dtype: str, args, work: str) -> dict:
    cmd = [sys.executable, "-m", "infinity.cli", "train", "--preset", args.preset, "--steps", str(args.steps),
           "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--seed", str(args.seed),
           "--offload-param", args.offload, "--offload-optimizer", args.offload,
           "--optimizer-state-dtype", state_dtype, "--json"]
    if args.eval_batches:
        # Validation only at the end: the same held-out batches for every state dtype.
        cmd += ["--eval-every", str(args.steps), "--eval-batches", str(args.eval_batches)]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    losses = summary["losses"]
    tail = losses[-20:]
    return {"state_dtype": summary.get("optimizer_state_dtype", state_dtype), "final_loss": losses[-1],
            "last20_mean": sum(tail) / len(tail), "first_loss": losses[0], "steps": len(losses),
            "val_loss": summary.get("val_loss"), "tokens_per_s": summary["tokens_per_s"],
            "wall_s": time.perf_counter() - started, "losses": losses}


class _kept:
    def __init__(self, path: str):
        os.makedirs(path, exist_ok=True)
        self.path = path

    def __enter__(self) -> str:
        return self.path

    def __exit__(self, *exc) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="50m")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--offload", choices=("cpu", "nvme"), default="cpu")
    parser.add_argument("--state-dtypes", default="fp32,bf16,int8")
    parser.add_argument("--eval-batches", type=int, default=64,
                        help="also measure the final loss on this many held-out micro-batches (default 64; 0: off); "
                             "one training batch's loss swings with the batch, the held-out mean does not")
    parser.add_argument("--work", help="folder for the runs' metrics (default: a temporary one, removed)")
    args = parser.parse_args()
    results = []
    with (tempfile.TemporaryDirectory(prefix="compact-quality-") if args.work is None else _kept(args.work)) as work:
        for state_dtype in args.state_dtypes.split(","):
            r = run(state_dtype, args, work)
            results.append(r)
            print(f"{state_dtype:>5}: loss {r['first_loss']:.4f} -> {r['final_loss']:.4f} (last 20 mean "
                  f"{r['last20_mean']:.4f})" + (f", held-out {r['val_loss']:.4f}" if r["val_loss"] is not None else "")
                  + f", {r['tokens_per_s']:.0f} tokens/s, {r['wall_s']:.0f} s", flush=True)
    base = next((r for r in results if r["state_dtype"] == "fp32"), None)
    if base is not None:
        for r in results:
            r["final_vs_fp32"] = r["final_loss"] / base["final_loss"] - 1
            r["last20_vs_fp32"] = r["last20_mean"] / base["last20_mean"] - 1
            held_out = ""
            if r["val_loss"] is not None and base["val_loss"] is not None:
                r["val_vs_fp32"] = r["val_loss"] / base["val_loss"] - 1
                held_out = f", held-out {100 * r['val_vs_fp32']:+.2f} %"
                bound = BOUNDS.get(r["state_dtype"])
                if bound is not None:
                    r["within_bound"] = abs(r["val_vs_fp32"]) <= bound
                    held_out += f" ({'within' if r['within_bound'] else 'OUTSIDE'} issue 13's ±{100 * bound:.0f} %)"
            print(f"{r['state_dtype']:>5}: final {100 * r['final_vs_fp32']:+.2f} % vs fp32, last-20 mean "
                  f"{100 * r['last20_vs_fp32']:+.2f} %{held_out}")
    print(json.dumps({"setting": vars(args), "cpu_count": os.cpu_count(), "results": results}))


if __name__ == "__main__":
    main()
