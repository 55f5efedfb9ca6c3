"""Bytes per rank in each tier for a model size and an offload setting.

Like DeepSpeed's ``estimate_zero3_model_states_mem_needs_*``, but covering the
host buffers and NVMe too. It follows the engine's layout (``infinity.placement.layout``,
``compute_shards``, ``offload_optimizer``, ``sharded_param``):

* every parameter is flattened and padded to a multiple of ``world_size``;
  a rank keeps ``ceil(numel / world_size)`` elements of it (its *shard*),
  and each shard starts at a multiple of ``ALIGN_NUMEL`` elements;
* the **compute shard** (2 bytes/element in bf16/fp16, 4 in fp32) rests in the
  ``offload_param`` tier (none -> device, cpu -> host, nvme -> nvme; with nvme
  the first ``max_in_cpu`` elements stay in host memory, and so do the
  persistent parameters' shards, packed);
* the **master** and the Adam **moments** ``exp_avg`` + ``exp_avg_sq`` rest in
  the ``offload_optimizer`` tier, in the form ``state_dtype`` says: fp32 (4 B
  + 8 B), bf16 (2 B + 4 B) or int8 (a bf16 master, 2 B, + one byte a moment
  and an fp32 scale per block of 256: ~2.03 B);
* the **gradient** shard rests in host memory when the optimizer is offloaded
  (cpu or nvme), on the device otherwise; in compute precision with one
  micro-batch per step (bf16/fp32), in fp32 when it accumulates over several
  or when fp16 gradients are unscaled;
* **gathered** full parameters (compute bytes, padded) live on the device:
  the persistent ones (at most ``param_persistence_threshold`` elements each)
  always, plus the largest layer being used; with params on NVMe the
  prefetcher also keeps up to ``max(prefetch_bucket_size, max_reuse_distance / 2)``
  elements gathered (ahead of need, or until their reuse in the backward: the
  last ``max_reuse_distance / 2`` elements of the forward), within
  ``max_live_parameters``. With one rank and the compute shard on the device,
  the shard *is* the full tensor: nothing is gathered;
* with a GPU (``gpu``: device memory apart from host memory) the compute
  shards in host memory cross up at every fetch, so the prefetcher keeps them
  gathered as it does NVMe ones; the optimizer's gradients accumulate over
  micro-batches in an fp32 **device** buffer (the engine's default where it
  fits) and are fp32 for an optimizer on the device (torch's fused AdamW);
  new compute shards that cross between memories go through one sub-group of
  **scratch** in the optimizer's memory (and a host one for NVMe);
* with params on NVMe and a GPU, host **I/O buffers** (compute bytes) stage the
  reads: the largest shard plus ``prefetch_bucket_size`` elements in flight,
  within the pool's budget of ``buffer_count x buffer_size`` elements (on a
  CPU-only machine shards land in place: no buffers);
* with the optimizer on NVMe, host **staging** holds ``offload_optimizer.buffer_count``
  sets (at least two; one without pipelining) of one sub-group's master, both
  moments (12 B in fp32) and new compute shard; with the compute shard on NVMe but the optimizer in memory, one
  sub-group of compute bytes of scratch;
* **activations** (device, only when the model's shape is known): what
  autograd keeps for one micro-batch without activation checkpointing. The
  engine's tier accounting does not see them: ``accounted`` leaves them out.

"device" is reported as its own tier even where there is no accelerator (it
is then CPU memory too). All numbers are bytes per rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, replace
from itertools import product

from infinity.config.tier_names import (OFFLOAD_DEVICES as OFFLOAD_CHOICES,  # (the name this module's users know)
                                        TIER_OF_OFFLOAD, TIERS)
from infinity.kernels.compact import checkpoint_bytes_per_element
from infinity.models.gpt import PRESETS, GPTConfig, count_params, largest_module_params, param_numels
from infinity.placement.host_budget import (staged_sub_group_numel, state_bytes_per_numel, state_nbytes,
                                            transient_reserve_nbytes)
from infinity.placement.layout import ALIGN_NUMEL, packed_offsets

__all__ = [
    "TIERS",
    "OFFLOAD_CHOICES",
    "estimate",
    "estimate_gpt",
    "alternatives",
    "host_floor_nbytes",
    "max_gpt",
    "format_max_gpt",
    "gpt_activation_nbytes",
    "gpt_like_largest_layer",
    "parse_count",
    "format_bytes",
    "format_table",
]

_COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
KINDS = (
    "compute_shard",
    "gathered_params",
    "gradients",
    "master",
    "moments",
    "param_io_buffers",
    "optimizer_staging",
    "step_undo",
    "activations",
)


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def estimate(
    num_params: int | None = None,
    *,
    world_size: int = 1,
    offload_param: str = "none",
    offload_optimizer: str = "none",
    precision: str = "bf16",
    param_numels: Sequence[int] | None = None,
    largest_layer_params: int | None = None,
    max_live_parameters: float = 1e9,
    prefetch_bucket_size: float = 5e7,
    max_reuse_distance: float = 1e9,
    param_persistence_threshold: float = 1e5,
    sub_group_size: float = 1e8,
    buffer_count: int = 5,
    buffer_size: float = 1e8,
    max_in_cpu: float = 1e9,
    pipeline: bool = True,
    optimizer_buffer_count: int = 4,
    gradient_accumulation_steps: int = 1,
    gpu: bool = True,
    activation_nbytes: int = 0,
    host_memory_budget: int | None = None,
    optimizer_max_in_cpu: int | None = None,
    overlap_step: bool = False,
    step_undo: bool = False,
    state_dtype: str = "fp32",
) -> dict:
    """Bytes per rank in each tier, by kind of state.

    Give either ``num_params`` or ``param_numels`` (each parameter's numel, in
    the model's order: padding, alignment, persistence and sub-groups exact).
    With only ``num_params`` the model is taken as one tensor per
    ``largest_layer_params`` and nothing persists. ``largest_layer_params``
    defaults to the largest of ``param_numels``, or to the MLP matrix of a GPT
    of that size (:func:`gpt_like_largest_layer`). Returns ``{"setting": {...},
    "shard_numel": int, "tiers": {tier: {kind: bytes}}, "totals": {tier: bytes},
    "accounted": {tier: bytes}}`` (``accounted``: without activations).

    With ``host_memory_budget`` (bytes) the engine's plan within it is followed: NVMe staging capped by the
    budget, compute shards and then optimizer sub-groups configured for NVMe kept in host memory while they
    fit (``optimizer_max_in_cpu`` elements at most), the step's first reads first (``overlap_step``: the last
    sub-groups). Without it, ``nvme`` means NVMe. ``state_dtype``: the optimizer states' form (fp32, bf16,
    int8; ``zero_optimization.offload_optimizer.state_dtype``).

    ``step_undo``: the step overlaps backward and may be undone (clipping or fp16): swapped optimizer states
    take a second extent on NVMe, and in-memory ones an undo copy where the budget leaves room for it.
    """
    _check_choice("offload_param", offload_param, OFFLOAD_CHOICES)
    _check_choice("offload_optimizer", offload_optimizer, OFFLOAD_CHOICES)
    _check_choice("precision", precision, tuple(_COMPUTE_BYTES))
    _check_choice("state_dtype", state_dtype, ("fp32", "bf16", "int8"))
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    sub_group_size, max_in_cpu = int(sub_group_size), int(max_in_cpu)
    sets = max(2, int(optimizer_buffer_count)) if pipeline else 1
    if param_numels is not None:
        numels = [int(n) for n in param_numels]
        num_params = sum(numels)
        shards = [math.ceil(n / world_size) for n in numels]
        if host_memory_budget is not None and offload_optimizer == "nvme":
            sub_group_size = staged_sub_group_numel(sub_group_size, largest_shard_numel=max(shards, default=0),
                                                    budget_nbytes=host_memory_budget, sets=sets,
                                                    bytes_per_numel=state_bytes_per_numel(state_dtype) + _COMPUTE_BYTES[precision])
        shard_numel = sum(shards)
        flat_numel = sum(_round_up(n, ALIGN_NUMEL) for n in shards)  # the rank's aligned flat space
        largest = max(numels, default=0)
        persistent_numel = sum(s * world_size for n, s in zip(numels, shards) if n <= param_persistence_threshold)
        sub_groups = _sub_group_numels(shards, sub_group_size)
        largest_sub_group = max(sub_groups, default=0)
        host_cached, cached_count = _prefix_within(shards, max_in_cpu)
        # persistent shards past the cache rest in host memory too, packed (infinity.params.compute_shards)
        persistent_left = [s for i, (n, s) in enumerate(zip(numels, shards))
                           if i >= cached_count and n <= param_persistence_threshold]
        persistent_host = packed_offsets(persistent_left)[1]
        persistent_off_nvme = sum(_round_up(s, ALIGN_NUMEL) for s in persistent_left)
    elif num_params is not None:
        num_params = int(num_params)
        shard_numel = flat_numel = math.ceil(num_params / world_size)
        largest = gpt_like_largest_layer(num_params)
        persistent_numel = 0
        largest_sub_group = min(sub_group_size, flat_numel)
        sub_groups = [largest_sub_group] * (flat_numel // largest_sub_group) + (
            [flat_numel % largest_sub_group] if largest_sub_group and flat_numel % largest_sub_group else [])
        host_cached = min(max_in_cpu, flat_numel)
        persistent_host = persistent_off_nvme = 0
    else:
        raise ValueError("give num_params or param_numels")
    if num_params <= 0:
        raise ValueError(f"the model must have parameters, got {num_params}")
    if largest_layer_params is not None:
        largest = int(largest_layer_params)

    cbytes = _COMPUTE_BYTES[precision]
    tiers: dict[str, dict[str, int]] = {t: dict.fromkeys(KINDS, 0) for t in TIERS}
    param_tier = TIER_OF_OFFLOAD[offload_param]
    optim_tier = TIER_OF_OFFLOAD[offload_optimizer]
    optim_memory = "host" if offload_optimizer != "none" else "device"

    if offload_param == "nvme":
        tiers["host"]["compute_shard"] += (host_cached + persistent_host) * cbytes
        tiers["nvme"]["compute_shard"] += (flat_numel - host_cached - persistent_off_nvme) * cbytes
    else:
        tiers[param_tier]["compute_shard"] += flat_numel * cbytes
    master_bytes = 4 if state_dtype == "fp32" else 2
    tiers[optim_tier]["master"] += flat_numel * master_bytes
    tiers[optim_tier]["moments"] += state_nbytes(state_dtype, flat_numel) - flat_numel * master_bytes
    # gradients stay in compute precision when nothing accumulates in them (one micro-batch a step, no fp16
    # unscaling); else fp32
    lossless = gradient_accumulation_steps == 1 and precision != "fp16" and not (gpu and offload_optimizer == "none")
    tiers[optim_memory]["gradients"] += flat_numel * (cbytes if lossless else 4)
    if gpu and offload_optimizer != "none" and gradient_accumulation_steps > 1:
        tiers["device"]["gradients"] += flat_numel * 4  # the fp32 accumulator; one copy down per step
    swapped_in = offload_param == "nvme" and host_cached < flat_numel  # fetches start with an NVMe read
    crosses_up = swapped_in or (gpu and offload_param != "none")       # fetches start with a read or a copy
    prefetching = crosses_up and (prefetch_bucket_size > 0 or max_reuse_distance > 0)
    if not (world_size == 1 and offload_param == "none"):
        padded_largest = math.ceil(largest / world_size) * world_size
        rest = max(0, num_params - persistent_numel)
        # The prefetcher keeps parameters gathered ahead of need and for reuse, within max_live_parameters.
        # A parameter's reuse distance is twice the elements used after it in the forward (the rest of
        # the forward, then the backward back to it): the last max_reuse_distance / 2 elements stay.
        kept = max(int(prefetch_bucket_size), int(max_reuse_distance) // 2)
        ahead = min(kept, int(max_live_parameters)) if prefetching else 0
        fetched = min(rest, padded_largest + ahead)
        tiers["device"]["gathered_params"] += (persistent_numel + fetched) * cbytes
    if swapped_in and gpu:
        # reads in flight: the largest shard plus the prefetched ones, within the pool's budget
        per_buffer = max(int(buffer_size), math.ceil(largest / world_size))
        ahead = min(int(prefetch_bucket_size), int(max_live_parameters)) if prefetching else 0
        in_flight = math.ceil((largest + ahead) / world_size)
        tiers["host"]["param_io_buffers"] += min(buffer_count * per_buffer, in_flight, flat_numel) * cbytes
    if offload_optimizer == "nvme":
        tiers["host"]["optimizer_staging"] += sets * (state_nbytes(state_dtype, largest_sub_group) + largest_sub_group * cbytes)
    elif offload_param == "nvme" and host_cached < flat_numel:
        tiers["host"]["optimizer_staging"] += largest_sub_group * cbytes
    elif gpu and offload_param == "none" and offload_optimizer == "cpu":
        tiers["host"]["optimizer_staging"] += largest_sub_group * cbytes  # new compute shards, pinned, on their way up
    if gpu and offload_optimizer == "none" and offload_param != "none":
        tiers["device"]["optimizer_staging"] += largest_sub_group * cbytes  # new compute shards on their way down
    tiers["device"]["activations"] += int(activation_nbytes)
    if host_memory_budget is not None:
        _plan_within_budget(tiers, host_memory_budget, gpu=gpu, cbytes=cbytes, sub_groups=sub_groups,
                            largest_shard=math.ceil(largest / world_size), offload_param=offload_param,
                            offload_optimizer=offload_optimizer, optimizer_max_in_cpu=optimizer_max_in_cpu,
                            overlap_step=overlap_step, state_dtype=state_dtype)

    if step_undo:
        _add_step_undo(tiers, host_memory_budget, gpu=gpu, optim_memory=optim_memory)

    totals = {t: sum(kinds.values()) for t, kinds in tiers.items()}
    accounted = dict(totals, device=totals["device"] - tiers["device"]["activations"])
    return {
        "setting": {
            "num_params": num_params,
            "world_size": world_size,
            "offload_param": offload_param,
            "offload_optimizer": offload_optimizer,
            "precision": precision,
            "largest_layer_params": largest,
            "max_live_parameters": int(max_live_parameters),
            "prefetch_bucket_size": int(prefetch_bucket_size),
            "max_reuse_distance": int(max_reuse_distance),
            "param_persistence_threshold": int(param_persistence_threshold),
            "sub_group_size": sub_group_size,
            "buffer_count": buffer_count,
            "buffer_size": int(buffer_size),
            "max_in_cpu": max_in_cpu,
            "pipeline": pipeline,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "gpu": gpu,
            "host_memory_budget": host_memory_budget,
            "state_dtype": state_dtype,
        },
        "shard_numel": shard_numel,
        "largest_sub_group_numel": largest_sub_group,
        "tiers": tiers,
        "totals": totals,
        "accounted": accounted,
        # What save_checkpoint writes per rank: master and moments (each in the narrowest exact dtype) and
        # the compute shard, for every element of the rank's shards (a frozen parameter's states are zeros).
        "checkpoint_nbytes": shard_numel * (checkpoint_bytes_per_element(state_dtype) + cbytes),
    }


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _sub_group_numels(shards: Sequence[int], sub_group_size: int) -> list[int]:
    """Runs of whole aligned shards of at most ``sub_group_size`` elements (one shard alone may exceed it)."""
    groups, start, offset, count = [], 0, 0, 0
    for n in shards:
        end = _round_up(offset + n, ALIGN_NUMEL)
        if count and end - start > sub_group_size:
            groups.append(_round_up(offset, ALIGN_NUMEL) - start)
            start, count = offset, 0
        offset, count = end, count + 1
    if count:
        groups.append(offset - start)
    return groups


def _plan_within_budget(tiers: dict, budget: int, *, gpu: bool, cbytes: int, sub_groups: list[int], largest_shard: int,
                        offload_param: str, offload_optimizer: str, optimizer_max_in_cpu: int | None,
                        overlap_step: bool, state_dtype: str = "fp32") -> None:
    """The engine's plan (``infinity.placement.host_budget``): what exceeds the budget of the parameter cache goes back
    to NVMe, then optimizer sub-groups on NVMe come to host memory while they fit."""
    largest_sub_group = max(sub_groups, default=0)
    reserve = transient_reserve_nbytes(largest_sub_group, largest_shard, cbytes) + largest_sub_group * cbytes

    if offload_param == "nvme":
        excess = max(0, _charged_to_host_budget(tiers, gpu=gpu) + reserve - budget)
        back = min(tiers["host"]["compute_shard"], _round_up(excess, cbytes))
        tiers["host"]["compute_shard"] -= back
        tiers["nvme"]["compute_shard"] += back
    if offload_optimizer == "nvme" and optimizer_max_in_cpu != 0:
        room = budget - _charged_to_host_budget(tiers, gpu=gpu) - reserve
        kept = kept_nbytes = 0
        for numel in (reversed(sub_groups) if overlap_step else sub_groups):
            nbytes = state_nbytes(state_dtype, numel)
            fits = kept_nbytes + nbytes <= room
            if fits and (optimizer_max_in_cpu is None or kept + numel <= optimizer_max_in_cpu):
                kept += numel
                kept_nbytes += nbytes
        master = kept * (4 if state_dtype == "fp32" else 2)
        for kind, nbytes in (("master", master), ("moments", kept_nbytes - master)):
            tiers["nvme"][kind] -= nbytes
            tiers["host"][kind] += nbytes


def _add_step_undo(tiers: dict, budget: int | None, *, gpu: bool, optim_memory: str) -> None:
    """What undoing a speculative step needs (``infinity.optim.overlapped_step``): the other side of every swapped
    sub-group's state keys, and one copy of the states in memory when the budget has room for it."""
    tiers["nvme"]["step_undo"] += tiers["nvme"]["master"] + tiers["nvme"]["moments"]
    in_memory = tiers[optim_memory]["master"] + tiers[optim_memory]["moments"]
    charged_to_host = optim_memory == "host" or not gpu
    if budget is not None and charged_to_host and _charged_to_host_budget(tiers, gpu=gpu) + in_memory > budget:
        return  # no room: those sub-groups wait for the norm instead
    tiers[optim_memory]["step_undo"] += in_memory


def _charged_to_host_budget(tiers: dict, *, gpu: bool) -> int:
    """What the host-memory budget is charged: host memory, and device memory where the device is the host."""
    device = 0 if gpu else sum(n for kind, n in tiers["device"].items() if kind != "activations")
    return sum(tiers["host"].values()) + device


def _largest_sub_group(shards: Sequence[int], sub_group_size: int) -> int:
    """Largest run of whole aligned shards of at most ``sub_group_size`` elements (one shard alone may exceed it)."""
    return max(_sub_group_numels(shards, sub_group_size), default=0)


def _prefix_within(shards: Sequence[int], limit: int) -> tuple[int, int]:
    """Aligned elements of the leading shards whose shards total at most ``limit`` (``offload_param.max_in_cpu``),
    and how many shards they are."""
    total, offset, count = 0, 0, 0
    for n in shards:
        if total + n > limit:
            break
        total += n
        offset = _round_up(offset, ALIGN_NUMEL) + n
        count += 1
    return offset, count


def gpt_like_largest_layer(num_params: int) -> int:
    """The largest layer of a GPT with ``num_params`` parameters: its ``d x 4d`` MLP matrix.

    Such a model has about ``12 * n_layer * d**2`` parameters; with the usual
    aspect ratio ``d ~ 128 * n_layer`` that gives ``d = (num_params * 128 / 12) ** (1/3)``.
    """
    d = (num_params * 128 / 12) ** (1 / 3)
    return min(int(num_params), int(4 * d * d + 4 * d))


def gpt_activation_nbytes(cfg, *, micro_batch: int, seq_len: int | None = None, precision: str = "bf16") -> int:
    """What autograd keeps for one micro-batch of ``GPT(cfg)`` (no activation checkpointing).

    Per block about 17 activations of ``(batch, seq, d_model)`` (Korthikanti et
    al.'s 34·s·b·h bytes at 2 bytes each; attention by a fused kernel, so no
    ``seq x seq`` term) plus the MLP's ``4 x`` wide ones counted in that 17;
    plus the logits in compute precision and their fp32 copy for the loss.
    """
    t = seq_len or cfg.seq_len
    cbytes = _COMPUTE_BYTES[precision]
    tokens = micro_batch * t
    per_block = 17 * tokens * cfg.d_model * cbytes
    logits = tokens * cfg.vocab_size * (cbytes + 4 + 4)  # logits, fp32 copy, its softmax grad
    return cfg.n_layer * per_block + logits + 2 * tokens * cfg.d_model * cbytes


def estimate_gpt(cfg, *, micro_batch: int = 1, seq_len: int | None = None, precision: str = "bf16", **kwargs) -> dict:
    """``estimate`` for ``GPT(cfg)``: exact per-parameter padding, largest layer and activations."""

    result = estimate(
        param_numels=param_numels(cfg),
        largest_layer_params=kwargs.pop("largest_layer_params", None) or largest_module_params(cfg),
        precision=precision,
        activation_nbytes=gpt_activation_nbytes(cfg, micro_batch=micro_batch, seq_len=seq_len, precision=precision),
        **kwargs,
    )
    result["setting"]["model"] = asdict(cfg)
    result["setting"]["micro_batch"] = micro_batch
    result["setting"]["seq_len"] = seq_len or cfg.seq_len
    return result


def alternatives(estimate_fn, **kwargs) -> list[dict]:
    """``estimate_fn(**kwargs)`` for every (offload_param, offload_optimizer) pair."""
    out = []
    for op, oo in product(OFFLOAD_CHOICES, OFFLOAD_CHOICES):
        out.append(estimate_fn(**{**kwargs, "offload_param": op, "offload_optimizer": oo}))
    return out


# --------------------------------------------------------------------------- the largest GPT that fits

SHAPE_TEMPLATES = ("125m", "350m", "760m", "1.3b", "2.7b", "6.7b", "13b", "20b", "30b")
"""The presets whose shape (width, heads, sequence length) ``max_gpt`` scales by depth."""
DEPTH_RANGE = (0.5, 1.5)
"""A template's depth is scaled within these factors of its own, so the model keeps a preset's aspect ratio."""


def host_floor_nbytes(result: dict) -> int:
    """What host memory must hold for the run ``result`` (an :func:`estimate`) whatever the budget, as the
    engine's minimum working set (``infinity.placement.host_budget``) counts it: gradient slices, compute shards
    and states that rest in host memory by the placement (not the ones the budget only lets stay there), two
    staging sets of the largest sub-group, the streaming reserve, and where the device is the host the largest
    gathered module twice. ``result`` should be made with ``max_in_cpu=0`` and ``optimizer_max_in_cpu=0``, so no
    cache counts."""
    s, tiers = result["setting"], result["tiers"]
    cbytes = _COMPUTE_BYTES[s["precision"]]
    host = tiers["host"]
    largest_sub_group = result["largest_sub_group_numel"]
    largest_shard = math.ceil(s["largest_layer_params"] / s["world_size"])
    floor = sum(n for kind, n in host.items() if kind not in ("optimizer_staging", "step_undo"))
    if s["offload_optimizer"] == "nvme":
        floor += 2 * (state_nbytes(s["state_dtype"], largest_sub_group) + largest_sub_group * cbytes)
    else:
        floor += host["optimizer_staging"]
    floor += transient_reserve_nbytes(largest_sub_group, largest_shard, cbytes)
    if not s["gpu"]:  # device memory is host memory: its buffers charge the same budget
        device = tiers["device"]
        floor += sum(n for kind, n in device.items() if kind not in ("gathered_params", "activations", "step_undo"))
        floor += 2 * largest_shard * s["world_size"] * cbytes
    return floor


def _nvme_need(result: dict) -> int:
    """NVMe bytes the run cannot do without (a speculative step's second side is taken only where there is room)."""
    return result["totals"]["nvme"] - result["tiers"]["nvme"]["step_undo"]


def max_gpt(*, host_memory_nbytes: int, nvme_nbytes: int, device_memory_nbytes: int | None = None,
            templates: Sequence[str] = SHAPE_TEMPLATES, micro_batch: int = 1, seq_len: int | None = None,
            **setting) -> dict:
    """The largest GPT of our presets' shape (a template preset's width, heads and sequence length, its depth
    scaled within :data:`DEPTH_RANGE`) whose run fits ``host_memory_nbytes`` of host memory (its floor,
    :func:`host_floor_nbytes`, within the budget: everything above the floor spills to NVMe) and
    ``nvme_nbytes`` of disk, and where given ``device_memory_nbytes`` of device memory (its accounted bytes and
    activations). ``setting``: :func:`estimate`'s keywords (offload tiers, precision, state dtype, gpu, ...).

    Returns ``{"config", "template", "num_params", "bound", "host_floor_nbytes", "nvme_nbytes",
    "bytes_per_param", "estimate"}``: ``bytes_per_param`` is each tier's bytes over the parameter count under
    that budget, ``bound`` the resource the next depth up exceeds; ``config`` is None when nothing fits."""
    if host_memory_nbytes <= 0 or nvme_nbytes < 0:
        raise ValueError(f"max_gpt: host memory must be positive and disk room not negative, got "
                         f"{host_memory_nbytes} and {nvme_nbytes}")
    unknown = [t for t in templates if t not in PRESETS]
    if unknown:
        raise ValueError(f"max_gpt: unknown template preset(s) {', '.join(unknown)}; presets: {', '.join(PRESETS)}")
    floor_setting = dict(setting, max_in_cpu=0, optimizer_max_in_cpu=0, host_memory_budget=host_memory_nbytes)
    best: dict | None = None

    def verdict(cfg: GPTConfig) -> str | None:
        """None when ``cfg`` fits, else the resource it exceeds."""
        floor = estimate_gpt(cfg, micro_batch=micro_batch, seq_len=seq_len, **floor_setting)
        if host_floor_nbytes(floor) > host_memory_nbytes:
            return "host memory"
        planned = estimate_gpt(cfg, micro_batch=micro_batch, seq_len=seq_len,
                               **dict(setting, host_memory_budget=host_memory_nbytes))
        if _nvme_need(planned) > nvme_nbytes:
            return "disk"
        if device_memory_nbytes is not None and planned["totals"]["device"] > device_memory_nbytes:
            return "device memory"
        return None

    for name in templates:
        template = PRESETS[name]
        low = max(1, math.ceil(template.n_layer * DEPTH_RANGE[0]))
        high = max(low, math.floor(template.n_layer * DEPTH_RANGE[1]))
        if verdict(replace(template, n_layer=low)) is not None:
            continue
        bound = None
        if (over := verdict(replace(template, n_layer=high))) is None:
            depth = high
        else:  # fits at low, not at high: the last depth that fits (fitting falls with depth)
            bound = over
            lo, hi = low, high
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if verdict(replace(template, n_layer=mid)) is None:
                    lo = mid
                else:
                    hi = mid
            depth = lo
        cfg = replace(template, n_layer=depth)
        if best is None or count_params(cfg) > best["num_params"]:
            best = {"config": cfg, "template": name, "num_params": count_params(cfg),
                    "bound": bound or f"the deepest {name} shape ({DEPTH_RANGE[1]} x its depth)"}
    if best is None:
        return {"config": None, "template": None, "num_params": 0, "bound": "host memory or disk",
                "host_floor_nbytes": None, "nvme_nbytes": None, "bytes_per_param": None, "estimate": None}
    planned = estimate_gpt(best["config"], micro_batch=micro_batch, seq_len=seq_len,
                           **dict(setting, host_memory_budget=host_memory_nbytes))
    floor = estimate_gpt(best["config"], micro_batch=micro_batch, seq_len=seq_len, **floor_setting)
    n = best["num_params"]
    best.update(host_floor_nbytes=host_floor_nbytes(floor), nvme_nbytes=_nvme_need(planned), estimate=planned,
                bytes_per_param={t: {kind: nbytes / n for kind, nbytes in planned["tiers"][t].items() if nbytes}
                                 for t in TIERS})
    best["config"] = asdict(best["config"])
    return best


def format_max_gpt(found: dict, *, host_memory_nbytes: int, nvme_nbytes: int) -> str:
    """``max_gpt``'s answer for people: the model, what bounds it, and the bytes a parameter takes in each tier."""
    budget = f"{format_bytes(host_memory_nbytes)} of host memory and {format_bytes(nvme_nbytes)} of disk"
    if found["config"] is None:
        return f"no GPT of our presets' shape fits {budget}"
    c, s = found["config"], found["estimate"]["setting"]
    lines = [f"the largest GPT of our presets' shape within {budget}: {found['num_params']:,} parameters "
             f"({c['n_layer']} layers x {c['d_model']} wide, {c['n_head']} heads: the {found['template']} preset's "
             f"shape); the next depth up exceeds {found['bound']}",
             f"{s['precision']} compute, params on {s['offload_param']}, optimizer on {s['offload_optimizer']}, "
             f"{s['state_dtype']} states; host floor {format_bytes(found['host_floor_nbytes'])}, "
             f"disk {format_bytes(found['nvme_nbytes'])}", "", "bytes per parameter:"]
    kinds = [k for k in KINDS if any(k in found["bytes_per_param"][t] for t in TIERS)]
    rows = [[k.replace("_", " ")] + [f"{found['bytes_per_param'][t].get(k, 0):.3g}" for t in TIERS] for k in kinds]
    rows.append(["total"] + [f"{sum(found['bytes_per_param'][t].values()):.3g}" for t in TIERS])
    lines.append(_table(["kind", *TIERS], rows))
    return "\n".join(lines)


# --------------------------------------------------------------------------- formatting

_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(text: str | int | float) -> int:
    """``"7B"``, ``"350M"``, ``"1.3e9"``, ``"125k"``, ``7000`` -> an int (>= 0)."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
        if not m:
            raise ValueError(f"cannot read a parameter count from {text!r} (try 7B, 350M, 1.3e9)")
        value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value < 0:
        raise ValueError(f"a count must be >= 0, got {text!r}")
    return int(round(value))


def format_bytes(n: float) -> str:
    """Bytes in binary units: ``0 B``, ``512 B``, ``1.50 KiB``, ``12.3 GiB``."""
    if n == 0:
        return "0"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.3g} {unit}" if abs(n) < 100 else f"{n:.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_table(chosen: dict, alts: Sequence[dict]) -> str:
    """The chosen setting's breakdown by kind, then one line per offload alternative."""
    s = chosen["setting"]
    head = (
        f"{s['num_params']:,} parameters, world size {s['world_size']}, {s['precision']}; "
        f"shard {chosen['shard_numel']:,} elements per rank"
    )
    if "micro_batch" in s:
        head += f"; micro-batch {s['micro_batch']} x {s['seq_len']} tokens"
    breakdown = [
        [kind.replace("_", " ")] + [format_bytes(chosen["tiers"][t][kind]) for t in TIERS]
        for kind in KINDS
        if any(chosen["tiers"][t][kind] for t in TIERS)
    ]
    breakdown.append(["total"] + [format_bytes(chosen["totals"][t]) for t in TIERS])
    alt_rows = []
    for a in alts:
        sa = a["setting"]
        mark = "*" if (sa["offload_param"], sa["offload_optimizer"]) == (s["offload_param"], s["offload_optimizer"]) else " "
        alt_rows.append(
            [f"{mark} {sa['offload_param']:>4} / {sa['offload_optimizer']:<4}"]
            + [format_bytes(a["totals"][t]) for t in TIERS]
        )
    return "\n".join(
        [
            head,
            "",
            f"offload_param={s['offload_param']}, offload_optimizer={s['offload_optimizer']} (bytes per rank):",
            _table(["kind", *TIERS], breakdown),
            f"a checkpoint: {format_bytes(chosen['checkpoint_nbytes'])} per rank ({s['state_dtype']} states saved "
            f"at {checkpoint_bytes_per_element(s['state_dtype'])} B an element, plus the compute shard)",
            "",
            "alternatives (offload_param / offload_optimizer; * = requested):",
            _table(["setting", *TIERS], alt_rows),
        ]
    )
