"""``infinity estimate``: bytes per rank in each tier (device, host, nvme) for a model and an offload setting.

    infinity estimate --params 7B --world-size 8 --offload-param nvme --offload-optimizer nvme
    infinity estimate --preset 1.3b --micro-batch 4 --json
    infinity estimate --max-params --offload-param nvme --offload-optimizer nvme --optimizer-state-dtype int8 --cpu \\
        --host-memory 7GiB --nvme-path /mnt/nvme --seq-len 16

Prints the requested setting broken down by kind of state, then every
offload alternative (none/cpu/nvme for parameters x optimizer) for comparison.
With ``--max-params``: the largest GPT of our presets' shape that this machine's
host memory (``--host-memory``, default 80%% of what is available) and disk
(the free room under ``--nvme-path``) hold in that setting, and the bytes a
parameter takes in each tier.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

from infinity.config.tier_names import OFFLOAD_DEVICES
from infinity.models.gpt import get_preset
from infinity.placement.estimate import (alternatives, estimate, estimate_gpt, format_max_gpt, format_table, max_gpt,
                                         parse_count)
from infinity.placement.host_budget import resolve_host_budget
from infinity.config.units import parse_host_memory

MAX_PARAMS = 10**15
"""A quadrillion parameters: above that a count is a typo, not a model."""


def _count(text: str) -> int:
    try:
        return parse_count(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=_count, metavar="N", help="parameter count: 7B, 350M, 1.3e9, ...")
    model.add_argument("--preset", metavar="NAME", help="one of our GPT presets (exact layout and activations)")
    model.add_argument("--max-params", action="store_true",
                       help="the largest GPT of our presets' shape that fits --host-memory and the disk under "
                            "--nvme-path in this setting, with its bytes per parameter in each tier")
    p.add_argument("--world-size", type=int, default=1, metavar="N", help="number of ranks (default 1)")
    p.add_argument("--offload-param", choices=OFFLOAD_DEVICES, default="none", help="where compute shards rest")
    p.add_argument("--offload-optimizer", choices=OFFLOAD_DEVICES, default="none", help="where master + moments rest")
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16", help="compute precision")
    p.add_argument("--optimizer-state-dtype", choices=("fp32", "bf16", "int8"), default="fp32",
                   help="form of master + moments: fp32 (12 B an element), bf16 (6 B), int8 (~4.03 B) (default fp32)")
    p.add_argument("--micro-batch", type=int, default=1, metavar="N", help="micro-batch per rank (with --preset)")
    p.add_argument("--grad-accum", type=int, default=1, metavar="N",
                   help="micro-batches per step; more than 1 keeps gradients in fp32 (default 1)")
    p.add_argument("--seq-len", type=int, default=None, metavar="N", help="tokens per sample (with --preset)")
    p.add_argument("--largest-layer", type=_count, default=None, metavar="N",
                   help="parameters of the largest layer (default: from the preset, or a GPT of that size)")
    p.add_argument("--max-live-parameters", type=_count, default=10**9, metavar="N",
                   help="gathered parameter budget on the device (default 1e9)")
    p.add_argument("--prefetch-bucket-size", type=_count, default=5 * 10**7, metavar="N",
                   help="parameters swapped in ahead of need with --offload-param nvme (default 5e7)")
    p.add_argument("--max-reuse-distance", type=_count, default=10**9, metavar="N",
                   help="parameters used again within this many stay gathered (default 1e9)")
    p.add_argument("--param-persistence-threshold", type=_count, default=10**5, metavar="N",
                   help="parameters this small stay gathered (default 1e5)")
    p.add_argument("--max-in-cpu", type=_count, default=0, metavar="N",
                   help="shard elements kept in host memory with --offload-param nvme (default 0, as "
                        "`infinity train` sets it; the engine's config default is 1e9)")
    p.add_argument("--sub-group-size", type=_count, default=10**8, metavar="N",
                   help="optimizer elements stepped at once (default 1e8, the engine's)")
    p.add_argument("--optimizer-buffer-count", type=int, default=4, metavar="N",
                   help="host staging sets with the optimizer on NVMe (offload_optimizer.buffer_count, default 4)")
    p.add_argument("--buffer-count", type=int, default=5, metavar="N", help="host buffers for NVMe params (default 5)")
    p.add_argument("--buffer-size", type=_count, default=10**8, metavar="N",
                   help="elements per host buffer for NVMe params (default 1e8)")
    p.add_argument("--cpu", action="store_true",
                   help="the ranks compute on the CPU (no GPU): NVMe reads need no host buffers")
    p.add_argument("--host-memory", metavar="SIZE", default=None,
                   help="host-memory budget per rank (8GiB, or a fraction of the available memory: 0.5, 50%%): "
                        "NVMe becomes a spill tier under it, as in the engine (default: no budget, nvme means nvme)")
    p.add_argument("--nvme-path", metavar="DIR", default=None,
                   help="with --max-params: the disk whose free room NVMe states may take (default: the temporary "
                        "folder's)")
    p.add_argument("--device-memory", metavar="SIZE", default=None,
                   help="with --max-params: device memory per rank (default: no bound on it)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _budget(text: str | None) -> int | None:
    if text is None:
        return None
    return resolve_host_budget(parse_host_memory(text, key="--host-memory"), local_ranks=1)


def run(args: argparse.Namespace) -> int:
    if args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
    if args.params is not None and args.params < 1:
        raise ValueError(f"--params must be at least 1, got {args.params}")
    if args.params is not None and args.params > MAX_PARAMS:
        raise ValueError(f"--params {args.params:.3g} is more than this estimate is made for (at most {MAX_PARAMS:.0e}, "
                         f"a quadrillion); did you mean a smaller count such as 7B or 1.3e12?")
    if args.grad_accum < 1:
        raise ValueError(f"--grad-accum must be >= 1, got {args.grad_accum}")
    if args.micro_batch < 1:
        raise ValueError(f"--micro-batch must be >= 1, got {args.micro_batch}")
    common = dict(
        world_size=args.world_size,
        precision=args.precision,
        largest_layer_params=args.largest_layer,
        max_live_parameters=args.max_live_parameters,
        prefetch_bucket_size=args.prefetch_bucket_size,
        max_reuse_distance=args.max_reuse_distance,
        gpu=not args.cpu,
        param_persistence_threshold=args.param_persistence_threshold,
        max_in_cpu=args.max_in_cpu,
        sub_group_size=args.sub_group_size,
        optimizer_buffer_count=args.optimizer_buffer_count,
        buffer_count=args.buffer_count,
        buffer_size=args.buffer_size,
        gradient_accumulation_steps=args.grad_accum,
        host_memory_budget=_budget(args.host_memory),
        state_dtype=args.optimizer_state_dtype,
    )
    if args.max_params:
        return _run_max_params(args, common)
    if args.preset is not None:
        cfg = get_preset(args.preset)
        if args.seq_len is not None and not 0 < args.seq_len <= cfg.seq_len:
            raise ValueError(f"--seq-len must be in 1..{cfg.seq_len} for preset {args.preset!r}, got {args.seq_len}")
        fn, common = estimate_gpt, dict(common, cfg=cfg, micro_batch=args.micro_batch, seq_len=args.seq_len)
    else:
        fn, common = estimate, dict(common, num_params=args.params)
    chosen = fn(**common, offload_param=args.offload_param, offload_optimizer=args.offload_optimizer)
    alts = alternatives(fn, **common)
    if args.json:
        print(json.dumps({"estimate": chosen, "alternatives": alts}))
    else:
        if args.preset is not None:
            print(f"preset {args.preset}: {chosen['setting']['model']}")
        print(format_table(chosen, alts))
    return 0


def _run_max_params(args: argparse.Namespace, common: dict) -> int:
    """``--max-params``: the machine's host memory and free disk, then the largest GPT that fits them."""
    import psutil

    host = common.pop("host_memory_budget")
    if host is None:
        host = resolve_host_budget(None, available_nbytes=psutil.virtual_memory().available, local_ranks=1)
    nvme_path = args.nvme_path or tempfile.gettempdir()
    if not os.path.isdir(nvme_path):
        raise OSError(f"--nvme-path {nvme_path!r} is not a folder")
    disk = shutil.disk_usage(nvme_path).free
    device = parse_host_memory(args.device_memory, key="--device-memory") if args.device_memory else None
    if isinstance(device, float):
        raise ValueError(f"--device-memory must be a size (80GiB), not a fraction: {args.device_memory!r}")
    for key in ("largest_layer_params",):
        common.pop(key)
    found = max_gpt(host_memory_nbytes=host, nvme_nbytes=disk, device_memory_nbytes=device,
                    micro_batch=args.micro_batch, seq_len=args.seq_len, **common,
                    offload_param=args.offload_param, offload_optimizer=args.offload_optimizer)
    if args.json:
        print(json.dumps(dict(found, host_memory_nbytes=host, disk_free_nbytes=disk, nvme_path=nvme_path)))
    else:
        print(format_max_gpt(found, host_memory_nbytes=host, nvme_nbytes=disk))
    return 0 if found["config"] is not None else 1
