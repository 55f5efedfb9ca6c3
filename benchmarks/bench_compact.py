"""Compact optimizer states in the engine (issue 13): step time and NVMe bytes
per step of ``offload_optimizer.state_dtype`` fp32, bf16 and int8, with the
optimizer states (and by default the parameters) on NVMe (``max_in_cpu`` 0, so
the disk is measured, not the host-memory spill).

The three engines live side by side in one process and their steps alternate
(fp32, bf16, int8, fp32, ...), so the machine's noise hits all alike; each
step's time includes its write-behind (flushed before the next engine's step,
which shares the disk). Ratios
are medians of per-round ratios, for the whole step and for ``engine.step()``
(``step_metrics()["optimizer_s"]``: with ``--no-overlap`` the NVMe state step
alone, read, update, write, after backward); bytes are the NVMe bytes read + written over
the measured steps (``step_metrics()``) divided by the steps (writes finish
behind the next step, so one step's window is not its own bytes). The last
line is JSON.

    python benchmarks/bench_compact.py                           # ~85M parameters, params on NVMe too
    python benchmarks/bench_compact.py --offload-param cpu       # the optimizer's bytes alone
    python benchmarks/bench_compact.py --layers 2 --steps 2      # a quick look
    python benchmarks/bench_compact.py --precision bf16 --compare-own-copies   # + bf16/int8 with the compute
                                                                 # shards in files of their own, not read from the master
    python benchmarks/bench_compact.py --layers 24 --d-model 2048 --heads 16 --precision bf16   # 1.3B, on a GPU

With CUDA present the engines compute on the GPU (the batch lives there and each
step's time ends after the device has finished): the step is then disk-bound,
the case the issue's speed targets are for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

# As the `infinity` CLI does: large blocks 2 MiB-aligned, so NVMe reads land in place (set before torch).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

from infinity.models.gpt import GPTConfig, count_params  # noqa: E402
from infinity.storage.bench import check_free_space, measure_nvme  # noqa: E402
from bench_overlap import build  # noqa: E402  (the same model on meta, seeded, initialized by the engine)

STATE_DTYPES = ("fp32", "bf16", "int8")


def engine_config(nvme_path: str, args, state_dtype: str, *, from_master: bool = True) -> dict:
    param = {"device": args.offload_param}
    if args.offload_param == "nvme":
        param.update(nvme_path=nvme_path, max_in_cpu=0, compute_from_master=from_master)
    optimizer = {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0, "state_dtype": state_dtype}
    return {
        "aio": {"block_size": 1 << 20, "queue_depth": 32},
        "bf16": {"enabled": args.precision == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "offload_param": param, "offload_optimizer": optimizer,
                              "sub_group_size": args.sub_group_size, "overlap_step_with_backward": args.overlap},
    }


def one_step(engine, batch) -> tuple[float, dict]:
    start = time.perf_counter()
    loss = engine(*batch)
    engine.backward(loss)
    engine.step()
    # The write-behind of this step's last sub-groups is waited for inside its time: otherwise it would land
    # in the next engine's step (they share the disk), and the engine after fp32 would pay for fp32's bytes.
    engine.optimizer.flush()
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the step's kernels are queued: its time ends when the device has run them
    return time.perf_counter() - start, engine.step_metrics()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=7, help="measured rounds (each steps every engine once)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sub-group-size", type=int, default=20_000_000)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="fp32",
                        help="compute precision (default fp32, the fast one on a CPU without bf16 units; bf16 halves "
                             "the parameter bytes)")
    parser.add_argument("--offload-param", choices=("nvme", "cpu"), default="nvme")
    parser.add_argument("--no-overlap", dest="overlap", action="store_false",
                        help="run the optimizer step after backward (its time then is the NVMe state step alone)")
    parser.add_argument("--compare-own-copies", action="store_true",
                        help="also step bf16 and int8 engines that write the compute shards files of their own "
                             "(offload_param.compute_from_master false) in the same rounds")
    parser.add_argument("--nvme-path", default=None, help="a directory on the NVMe tier (default: a temporary one)")
    args = parser.parse_args()
    from infinity.runtime.hardware import machine_description

    cfg = GPTConfig(n_layer=args.layers, n_head=args.heads, d_model=args.d_model, seq_len=args.seq_len)
    numel = count_params(cfg)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    batch = (tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device))
    print(f"machine: {machine_description()}")
    print(f"model: {numel / 1e6:.0f}M parameters, batch {args.batch} x {args.seq_len} tokens, {args.precision}; "
          f"params -> {args.offload_param}, optimizer -> nvme")

    with tempfile.TemporaryDirectory(dir=args.nvme_path, prefix="bench-compact-") as nvme:
        check_free_space(nvme, numel * (12 + 6 + 5 + 3 * 4) + (1 << 30))
        bw = measure_nvme(nvme, nbytes=1 << 30, block_size=1 << 20, queue_depth=32)
        print(f"nvme bandwidth (infinity bench, 1 GiB, 1 MiB blocks, QD 32): write {bw.write_GBps:.2f} GB/s, "
              f"read {bw.read_GBps:.2f} GB/s")
        variants = {d: (d, True) for d in STATE_DTYPES}
        if args.compare_own_copies:
            variants.update({f"{d} own copies": (d, False) for d in STATE_DTYPES[1:]})
        engines = {name: build(cfg, engine_config(nvme, args, d, from_master=from_master))
                   for name, (d, from_master) in variants.items()}
        times = {d: [] for d in engines}
        nbytes = {d: [0, 0] for d in engines}
        staged = {d: 0 for d in engines}  # compute-shard bytes copied from a staging set, not read from NVMe
        optimizer_s = {d: [] for d in engines}
        for i in range(args.warmup + args.steps):
            for name, engine in engines.items():  # alternate, so the machine's noise hits all of them alike
                elapsed, metrics = one_step(engine, batch)
                if i >= args.warmup:
                    times[name].append(elapsed)
                    nbytes[name][0] += metrics["tiers"]["nvme"]["bytes_read"]
                    nbytes[name][1] += metrics["tiers"]["nvme"]["bytes_written"]
                    optimizer_s[name].append(metrics["optimizer_s"])
                    staged[name] += metrics["compute_shards_from_staging_nbytes"]
            print("  round {}: {}".format(i, ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items() if t))
                  if i >= args.warmup else f"  round {i}: warm-up", flush=True)
        for engine in engines.values():
            engine.close()

    result = {"params": numel, "machine": machine_description(), "setting": vars(args),
              "read_GBps": bw.read_GBps, "write_GBps": bw.write_GBps, "by_state_dtype": {}}
    base_bytes = sum(nbytes["fp32"]) / args.steps
    for name, (state_dtype, from_master) in variants.items():
        per_step = sum(nbytes[name]) / args.steps
        entry = {
            "state_dtype": state_dtype,
            "compute_from_master": from_master and state_dtype != "fp32" and args.offload_param == "nvme"
                                   and args.precision == "bf16",
            "step_s": statistics.median(times[name]),
            "optimizer_s": statistics.median(optimizer_s[name]),
            "nvme_bytes_per_step": per_step,
            "nvme_read_per_step": nbytes[name][0] / args.steps,
            "nvme_written_per_step": nbytes[name][1] / args.steps,
            "from_staging_per_step": staged[name] / args.steps,
            "bytes_vs_fp32": per_step / base_bytes,
            "speedup_vs_fp32": statistics.median(a / b for a, b in zip(times["fp32"], times[name])),
            "optimizer_speedup_vs_fp32": statistics.median(a / b for a, b in zip(optimizer_s["fp32"], optimizer_s[name])),
            "io_floor_s": (nbytes[name][0] / bw.read_GBps + nbytes[name][1] / bw.write_GBps) / 1e9 / args.steps,
        }
        result["by_state_dtype"][name] = entry
        print(f"{name:>15}: step {entry['step_s']:.2f} s (speed-up vs fp32 {entry['speedup_vs_fp32']:.2f} x, median of "
              f"per-round ratios), NVMe {per_step / 1e9:.3f} GB a step ({entry['bytes_vs_fp32']:.3f} x fp32's), "
              f"I/O floor {entry['io_floor_s']:.2f} s, {entry['from_staging_per_step'] / 1e9:.3f} GB of compute "
              f"shards from staging sets; engine.step() {entry['optimizer_s']:.2f} s "
              f"({entry['optimizer_speedup_vs_fp32']:.2f} x)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
