"""``infinity estimate``: bytes per rank in each tier (device, host, nvme) for a model and an offload setting.

    infinity estimate --params 7B --world-size 8 --offload-param nvme --offload-optimizer nvme
    infinity estimate --preset 1.3b --micro-batch 4 --json

Prints the requested setting broken down by kind of state, then every
offload alternative (none/cpu/nvme for parameters x optimizer) for comparison,
then the step-time model's predicted step on this machine and the resource that
binds it (from the figures `infinity bench --machine` cached; ``--json`` has them
under ``step_time``).
"""

from __future__ import annotations

import argparse
import json

from infinity.placement.estimate import alternatives, estimate, estimate_gpt, format_table, parse_count
from infinity.config.tier_names import OFFLOAD_DEVICES
from infinity.placement.step_time import format_prediction, predict_from_estimate
from infinity.runtime.machine_figures import cache_path, load_cached


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
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _budget(text: str | None) -> int | None:
    if text is None:
        return None
    from infinity.placement.host_budget import parse_host_memory, resolve_host_budget
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
    if args.preset is not None:
        from infinity.models.gpt import get_preset

        cfg = get_preset(args.preset)
        if args.seq_len is not None and not 0 < args.seq_len <= cfg.seq_len:
            raise ValueError(f"--seq-len must be in 1..{cfg.seq_len} for preset {args.preset!r}, got {args.seq_len}")
        fn, common = estimate_gpt, dict(common, cfg=cfg, micro_batch=args.micro_batch, seq_len=args.seq_len)
    else:
        fn, common = estimate, dict(common, num_params=args.params)
    chosen = fn(**common, offload_param=args.offload_param, offload_optimizer=args.offload_optimizer)
    alts = alternatives(fn, **common)
    step_time, step_note = predicted_step(chosen, micro_batch=args.micro_batch, seq_len=args.seq_len)
    if args.json:
        print(json.dumps({"estimate": chosen, "alternatives": alts, "step_time": step_time,
                          **({"step_time_note": step_note} if step_note else {})}))
    else:
        if args.preset is not None:
            print(f"preset {args.preset}: {chosen['setting']['model']}")
        print(format_table(chosen, alts))
        print()
        print(step_note)
    return 0


def predicted_step(est: dict, *, micro_batch: int, seq_len: int | None) -> tuple[dict | None, str]:
    """The step-time model's prediction for the estimate on this machine (``{"predicted_s", "bound_by",
    "resources"}``, or None without cached figures) and a line saying it, or how to get it."""
    figures = load_cached()
    if figures is None:
        return None, (f"predicted step: no figures of this machine at {cache_path()}; "
                      f"`infinity bench --machine` measures them (a few seconds)")
    s = est["setting"]
    where = f"{figures.machine}" + ("" if s["gpu"] == (figures.device == "cuda") else
                                     f" (its {figures.device.upper()} as the device)")
    try:
        prediction = predict_from_estimate(figures, est, micro_batch=micro_batch, seq_len=seq_len)
    except ValueError as err:  # a path the figures lack (no disk measured, say)
        return None, f"predicted step: {err}"
    tokens = f"micro-batch {micro_batch} x {seq_len or s.get('seq_len') or 1024} tokens"
    return prediction.as_dict(), f"{format_prediction(prediction)}; {tokens}, on {where}"
