"""Scale under a host-memory budget: the largest GPT this machine trains with parameters and optimizer on NVMe
(the optimizer states that fit the budget stay in host memory), each run's peak RSS against its budget, the NVMe
bytes a step moves, the seconds it takes, and the disk's floor for those bytes measured in the same run.

First the disk: a set of files (``--disk-bench-size``, 1 GiB each) written, read, then half read while half is
rewritten, with O_DIRECT through the engine's own AsyncIO at its block size and queue depth (1 MiB, 32), so the
bandwidth is the sustained one, not a burst's. Then each model runs ``infinity train`` in its own process (its
peak RSS is its own) and its JSON summary and per-step metrics are read back. A model passes when it trains its
steps with finite losses, the last below the first, within ``--max-rss``.

    python benchmarks/bench_scale.py --presets 2.7b --steps 3 --lr 1e-6 --host-memory 7GiB --max-rss 8GiB
    python benchmarks/bench_scale.py --presets max --steps 3 --lr 1e-6 --host-memory 7GiB --max-rss 8GiB
    python benchmarks/bench_scale.py --presets 350m --steps 3 --host-memory 1GiB --disk-bench-size 4GiB   # a look

``max`` is the largest GPT of our presets' shape that ``infinity estimate --max-params`` says fits the budget and
the free disk (less ``--disk-slack``). ``--above N`` then checks that answer against the machine: it runs the same
shape one layer deeper, then two, ... (at most N), until one fails, each without the estimate's own disk check
(``INFINITY_NO_ROOM_CHECK=1``), so the disk and the host budget themselves say whether it trains. The largest that
trained and the smallest that did not bracket the true largest; on a disk of its own (a small filesystem, say,
so the run is short) the disk is the bound:

    truncate -s 16G /tmp/disk16.img && mkfs.ext4 -q -m 0 /tmp/disk16.img && mkdir -p /mnt/disk16 \
        && mount -o loop /tmp/disk16.img /mnt/disk16
    python benchmarks/bench_scale.py --presets max --above 3 --optimizer-state-dtype int8 --steps 3 --lr 1e-6 \
        --host-memory 7GiB --max-rss 8GiB --nvme-path /mnt/disk16 --disk-bench-size 4GiB --disk-slack 0 ``--precision auto`` (the default) computes in bf16 where the CPU or GPU has
bf16 units and in fp32 where it would emulate them (an AVX2-only CPU runs a bf16 matmul several times slower).

The last line is one JSON object: the largest passing run's ``num_params``, ``losses``, ``step_s`` (median of the
steps after the first), ``nvme_bytes_per_step`` (the last step's reads and writes), ``io_floor_s`` (those bytes at
the read and write rates measured here; ``io_floor_mixed_s`` at the mixed rate), ``peak_rss_bytes``,
``host_budget_bytes``, ``tflops`` on a GPU, and ``rows``: every run's figures. ``last_step_over_io_floor`` is the
last step's seconds over the floor of its own bytes: the first step reads no moments and the second writes no
earlier step's, so the last of three is the one that moves a steady step's bytes.

    # a GPU machine (125 GiB host, 64 GiB disk): >= 20B with int8 states, host memory and NVMe
    python benchmarks/bench_scale.py --presets 20b --optimizer-state-dtype int8 --steps 3 --lr 1e-6 \\
        --host-memory 100GiB --max-rss 120GiB --disk-bench-size 8GiB

Swap files go under --nvme-path (default: the temporary folder), in a folder removed after each run, as are the
disk benchmark's files.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace

import torch

from infinity.commands.train_checks import ROOM_CHECK_ENV
from infinity.commands.train_estimate import model_decays
from infinity.commands.train_plan import ADAMW_DEFAULTS
from infinity.config.units import parse_host_memory
from infinity.models.gpt import PRESETS, GPTConfig, count_params, get_preset
from infinity.placement.estimate_gpt import estimate_gpt
from infinity.placement.max_model import max_gpt
from infinity.placement.host_budget import resolve_host_budget
from infinity.runtime.hardware import PRECISION_CHOICES, machine_description, resolve_precision
from infinity.storage.bench import BenchBuffers, measure_nvme_sustained, parse_size

ENGINE_BLOCK_SIZE = 1 << 20
"""The engine's aio block size (``aio.block_size``'s default), which the disk is measured at."""
ENGINE_QUEUE_DEPTH = 32
"""The engine's aio queue depth (``aio.queue_depth``'s default)."""
BENCH_FILE_NBYTES = 1 << 30

MODEL_FILE = """\
# A GPT of our presets' shape for bench_scale.py, built on the meta device (the engine materializes it in shards).
import torch
from infinity.models.gpt import GPT, GPTConfig


def build_model():
    with torch.device("meta"):
        return GPT(GPTConfig(**{config!r}))
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="2.7b", help="comma-separated presets, smallest first; 'max' for the largest "
                                                     "that estimate says fits")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--precision", default="auto", choices=PRECISION_CHOICES,
                   help="compute precision (default auto: bf16 where the device has bf16 units, else fp32)")
    p.add_argument("--lr", default=None, help="peak learning rate (default: the preset's; a few steps from scratch "
                                              "want less: Adam's first step moves every weight by about lr)")
    p.add_argument("--optimizer-state-dtype", default="fp32", choices=("fp32", "bf16", "int8"),
                   help="form of master and moments: fp32 12 B, bf16 6 B, int8 ~4.03 B an element")
    p.add_argument("--host-memory", default="7GiB", help="the engine's host-memory budget per run")
    p.add_argument("--max-rss", default="8GiB", help="the peak RSS a run must stay within")
    p.add_argument("--nvme-path", default=None, help="where swap files and the disk benchmark go (default: temp)")
    p.add_argument("--disk-bench-size", default="32GiB",
                   help="the disk benchmark's file set (at most 80%% of the free room; 0 skips it, and no floor)")
    p.add_argument("--disk-slack", default="4GiB", help="free disk 'max' leaves to others")
    p.add_argument("--above", type=int, default=0, metavar="N",
                   help="after 'max', run its shape 1, 2, ... N layers deeper until one fails, without the estimate's "
                        "disk check: how close the estimate is to the largest that trains")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block in backward (infinity train's flag; 'max' counts activations so)")
    p.add_argument("--trace", default=None, help="write each run's Chrome trace here (PRESET is replaced by its name)")
    p.add_argument("--out", default=None, help="also write the JSON line to this file")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- the disk


def measure_disk(root: str, size_text: str) -> dict | None:
    """The disk's sustained write, read and mixed rates over a file set under ``root`` (removed after)."""
    free = shutil.disk_usage(root).free
    nbytes = min(parse_size(size_text), int(free * 0.8)) // BENCH_FILE_NBYTES * BENCH_FILE_NBYTES
    if nbytes < 2 * BENCH_FILE_NBYTES:
        return None
    folder = tempfile.mkdtemp(prefix="scale-disk-", dir=root)
    try:
        r = measure_nvme_sustained(folder, nbytes=nbytes, file_nbytes=BENCH_FILE_NBYTES, block_size=ENGINE_BLOCK_SIZE,
                                   queue_depth=ENGINE_QUEUE_DEPTH, buffers=BenchBuffers())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"result": r, "nbytes": r.nbytes, "backend": r.backend, "block_size": r.block_size,
            "queue_depth": r.queue_depth, "write_GBps": r.write_GBps, "read_GBps": r.read_GBps,
            "mixed_GBps": r.mixed_GBps}


# --------------------------------------------------------------------------- the models


def largest_that_fits(args, precision: str, nvme_root: str) -> dict:
    """``infinity estimate --max-params`` for this run's setting, budget and free disk."""
    free = shutil.disk_usage(nvme_root).free - parse_size(args.disk_slack)
    found = max_gpt(host_memory_nbytes=host_budget(args), nvme_nbytes=max(0, free), micro_batch=args.micro_batch,
                    seq_len=args.seq_len, precision=precision, offload_param="nvme", offload_optimizer="nvme",
                    gpu=torch.cuda.is_available(), state_dtype=args.optimizer_state_dtype, max_in_cpu=0,
                    activation_checkpointing=args.activation_checkpointing,
                    decays=lambda cfg: model_decays(cfg, ADAMW_DEFAULTS["weight_decay"]))  # as infinity train lays out
    if found["config"] is None:
        raise SystemExit(f"bench_scale: no GPT of our presets' shape fits {args.host_memory} and {free / 1e9:.0f} GB")
    return found


def host_budget(args) -> int:
    return resolve_host_budget(parse_host_memory(args.host_memory, key="--host-memory"))


def nvme_share(cfg: GPTConfig, args, precision: str) -> int:
    """The bytes a run puts on NVMe under the host-memory budget (``infinity estimate``'s plan), without the second
    side a speculative step takes only where the disk has room for it."""
    planned = estimate_gpt(cfg, micro_batch=args.micro_batch, seq_len=args.seq_len, precision=precision,
                           offload_param="nvme", offload_optimizer="nvme", gpu=torch.cuda.is_available(),
                           state_dtype=args.optimizer_state_dtype, host_memory_budget=host_budget(args),
                           activation_checkpointing=args.activation_checkpointing)
    return planned["totals"]["nvme"] - planned["tiers"]["nvme"]["step_undo"]


def run_model(name: str, cfg: GPTConfig, args, precision: str, nvme_root: str, disk: dict | None, *,
              probe: bool = False) -> dict:
    """``cfg`` trained by ``infinity train`` in its own process; skipped where the estimate says the disk has not
    room for it, unless ``probe``: then the estimate's checks are off and the run finds out."""
    nvme = tempfile.mkdtemp(prefix=f"scale-{name}-", dir=nvme_root)
    work = tempfile.mkdtemp(prefix=f"scale-{name}-run-")
    needed = nvme_share(cfg, args, precision)
    free = shutil.disk_usage(nvme).free
    if needed > free and not probe:
        shutil.rmtree(nvme, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        return {"preset": name, "skipped": f"needs ~{needed / 1e9:.0f} GB on NVMe, {free / 1e9:.0f} GB free"}
    try:
        model = ["--preset", name]
        if name not in PRESETS:
            path = os.path.join(work, "model.py")
            with open(path, "w", encoding="utf-8") as f:
                f.write(MODEL_FILE.format(config=asdict(cfg)))
            model = ["--model", path]
        cmd = [sys.executable, "-m", "infinity.cli", "train", *model, "--steps", str(args.steps),
               "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--precision", precision,
               "--offload-param", "nvme", "--offload-optimizer", "nvme", "--nvme-path", nvme,
               "--host-memory", args.host_memory, "--optimizer-state-dtype", args.optimizer_state_dtype,
               "--run-dir", os.path.join(work, "run"), "--json"]
        cmd += ["--lr", args.lr] if args.lr else []
        cmd += ["--activation-checkpointing"] if args.activation_checkpointing else []
        cmd += ["--trace", args.trace.replace("PRESET", name)] if args.trace else []
        start = time.perf_counter()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **({ROOM_CHECK_ENV: "1"} if probe else {})}
        returncode, stdout, stderr, disk_used = _run_watching_disk(cmd, env, nvme)
        wall = time.perf_counter() - start
        if returncode != 0:
            return {"preset": name, "num_params": count_params(cfg), "config": asdict(cfg), "disk_used_peak_bytes":
                    disk_used, "failed": stderr.strip().splitlines()[-3:] or [f"exit {returncode}"]}
        summary = json.loads(stdout.strip().splitlines()[-1])
        steps = _metrics(summary.get("metrics_file"))
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return {**_row(name, cfg, summary, steps, wall, disk, args), "disk_used_peak_bytes": disk_used}


def _run_watching_disk(cmd: list[str], env: dict, folder: str) -> tuple[int, str, str, int]:
    """Run ``cmd``; its exit status, output, and the most the filesystem of ``folder`` held above what it held at
    the start (sampled each second: what the run's files really took on the disk)."""
    base = shutil.disk_usage(folder).used
    peak = 0
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    while True:
        try:
            stdout, stderr = proc.communicate(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            peak = max(peak, shutil.disk_usage(folder).used - base)
    return proc.returncode, stdout, stderr, max(peak, 0)


def _metrics(path: str | None) -> list[dict]:
    if not path or not os.path.exists(path):
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _row(name: str, cfg: GPTConfig, summary: dict, steps: list[dict], wall: float, disk: dict | None, args) -> dict:
    losses = summary["losses"]
    seconds = summary.get("step_s") or [float(s["step_s"]) for s in steps]
    steady = seconds[1:] or seconds
    step_s = statistics.median(steady)
    last = steps[-1] if steps else {}
    bytes_read = int(float(last.get("nvme_bytes_read", 0)))
    bytes_written = int(float(last.get("nvme_bytes_written", 0)))
    row = {
        "preset": name, "config": asdict(cfg), "num_params": summary["num_params"], "steps": len(losses),
        "losses": losses, "loss_finite_and_falling": all(math.isfinite(x) for x in losses) and losses[-1] < losses[0],
        "step_seconds": seconds, "step_s": step_s,
        "nvme_bytes_per_step": bytes_read + bytes_written, "nvme_bytes_read": bytes_read,
        "nvme_bytes_written": bytes_written,
        "peak_rss_bytes": summary["peak_rss_bytes"], "host_budget_bytes": host_budget(args),
        "host_peak_nbytes": summary["tiers"]["host"]["peak_nbytes"], "nvme_peak_nbytes": summary["tiers"]["nvme"]["peak_nbytes"],
        "exposed_io_s": float(last.get("exposed_io_s", "nan") or "nan"), "wall_s": wall,
        "precision": summary["precision"], "optimizer_state_dtype": summary["optimizer_state_dtype"],
        "tokens_per_step": summary["tokens_per_step"],
    }
    if disk is not None and bytes_read + bytes_written:
        r = disk["result"]
        row["io_floor_s"] = r.floor_s(bytes_read, bytes_written)
        row["io_floor_mixed_s"] = r.mixed_floor_s(bytes_read, bytes_written)
        # each step after the first against the floor of its own bytes (the first reads no moments, the second
        # no last step's writes of them: only later steps move a steady step's bytes)
        ratios, ratios_mixed = [], []
        for seconds_i, metrics in list(zip(seconds, steps))[1:] or list(zip(seconds, steps)):
            moved = int(float(metrics["nvme_bytes_read"])), int(float(metrics["nvme_bytes_written"]))
            ratios.append(seconds_i / r.floor_s(*moved))
            ratios_mixed.append(seconds_i / r.mixed_floor_s(*moved))
        row["step_over_io_floor_by_step"] = ratios
        row["last_step_over_io_floor"] = ratios[-1]
        row["last_step_over_io_floor_mixed"] = ratios_mixed[-1]
    if torch.cuda.is_available():  # 6 N FLOPs a token (forward and backward), attention left out
        row["tflops"] = 6 * summary["num_params"] * summary["tokens_per_step"] / step_s / 1e12
    return row


def _trained(row: dict) -> bool:
    """The run trained every step with finite losses within ``--max-rss`` (whether a few steps' losses fall says
    how it learns, not whether it fits)."""
    return bool(row.get("within_max_rss")) and all(math.isfinite(x) for x in row.get("losses") or [math.nan])


def _report(row: dict, max_rss: int) -> dict:
    """One line for ``row`` (marked ``within_max_rss``), and ``row``."""
    name = row["preset"]
    if "losses" not in row:
        print(f"{name:>10}  {row.get('skipped') or row.get('failed')}", flush=True)
        return row
    row["within_max_rss"] = row["peak_rss_bytes"] <= max_rss
    floor = f"{row['io_floor_s']:8.1f}" if "io_floor_s" in row else f"{'-':>8}"
    print(f"{name:>10} {row['num_params']:>14,} {row['peak_rss_bytes'] / 2**30:8.2f} GiB "
          f"{row['nvme_bytes_per_step'] / 1e9:13.1f} {row['step_s']:8.1f} {floor}  "
          f"{row['losses'][0]:.3f} -> {row['losses'][-1]:.3f}", flush=True)
    return row


def _max_params_check(estimated: dict, rows: list[dict], probes: list[dict]) -> dict:
    """The estimate against what trained: the largest run that trained (the estimate's own or a deeper one) and
    the smallest deeper one that did not bracket the true largest of this shape."""
    trained = [r["num_params"] for r in rows + probes if _trained(r)]
    failed = [r for r in probes if not _trained(r)]
    largest = max(trained, default=None)
    first_failed = failed[0]["num_params"] if failed else None
    n = estimated["num_params"]
    check = {"estimate_max_params": n, "estimate_trained": any(_trained(r) and r["num_params"] == n for r in rows),
             "largest_trained_params": largest, "smallest_failed_params": first_failed,
             "smallest_failed_why": (failed[0].get("failed") or failed[0].get("skipped")) if failed else None}
    if largest and first_failed:  # the true largest lies in [largest, first_failed)
        check["estimate_over_largest_trained"] = n / largest
        check["true_largest_at_most_over_estimate"] = first_failed / n
    return check


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    max_rss = parse_host_memory(args.max_rss, key="--max-rss")
    nvme_root = args.nvme_path or tempfile.gettempdir()
    chosen = resolve_precision(args.precision)
    print(f"machine: {machine_description()}; {os.cpu_count()} CPUs")
    print(f"precision {chosen.precision} ({chosen.reason}); optimizer states {args.optimizer_state_dtype}; host budget "
          f"{args.host_memory}; NVMe under {nvme_root}", flush=True)
    disk = None
    if parse_size(args.disk_bench_size) > 0:
        disk = measure_disk(nvme_root, args.disk_bench_size)
    if disk is not None:
        print(f"disk: {disk['nbytes'] / 2**30:.0f} GiB in {BENCH_FILE_NBYTES >> 30} GiB files, {disk['backend']}, "
              f"{disk['block_size'] >> 20} MiB blocks, QD {disk['queue_depth']}: write {disk['write_GBps']:.2f} GB/s, "
              f"read {disk['read_GBps']:.2f} GB/s, mixed {disk['mixed_GBps']:.2f} GB/s", flush=True)
    estimated = None
    models = []
    for name in [p.strip() for p in args.presets.split(",")]:
        if name == "max":
            estimated = largest_that_fits(args, chosen.precision, nvme_root)
            cfg = GPTConfig(**estimated["config"])
            name = f"max-{estimated['num_params'] / 1e9:.2f}b"
            print(f"estimate --max-params: {estimated['num_params']:,} parameters ({cfg.n_layer} x {cfg.d_model}, the "
                  f"{estimated['template']} shape), bound by {estimated['bound']}", flush=True)
        else:
            cfg = get_preset(name)
        models.append((name, cfg))
    rows = []
    print(f"{'model':>10} {'params':>14} {'peak RSS':>10} {'NVMe GB/step':>13} {'s/step':>8} {'floor s':>8}  loss")
    for name, cfg in models:
        rows.append(_report(run_model(name, cfg, args, chosen.precision, nvme_root, disk), max_rss))
    probes = []
    if args.above and estimated is not None:
        deepest = GPTConfig(**estimated["config"])
        for extra in range(1, args.above + 1):
            cfg = replace(deepest, n_layer=deepest.n_layer + extra)
            name = f"max+{extra}-{count_params(cfg) / 1e9:.2f}b"
            probes.append(_report(run_model(name, cfg, args, chosen.precision, nvme_root, disk, probe=True), max_rss))
            if not _trained(probes[-1]):
                break
    passed = [r for r in rows if r.get("within_max_rss") and r.get("loss_finite_and_falling")]
    top = max(passed, key=lambda r: r["num_params"], default={})
    line = {**{k: v for k, v in top.items() if k != "config"},
            "machine": machine_description(), "cpus": os.cpu_count(), "precision_reason": chosen.reason,
            "host_memory": args.host_memory, "max_rss": args.max_rss,
            "disk": {k: v for k, v in disk.items() if k != "result"} if disk else None,
            "estimate_max_params": estimated["num_params"] if estimated else None, "rows": rows}
    if probes:
        line["max_params_check"] = _max_params_check(estimated, rows, probes)
        line["rows_above"] = probes
    text = json.dumps(line)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    return 0 if rows and all(r.get("within_max_rss") and r.get("loss_finite_and_falling") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
