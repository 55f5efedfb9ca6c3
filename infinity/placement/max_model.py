"""The largest GPT of our presets' shape that a machine's host memory and disk hold in a setting
(``infinity estimate --max-params``), found with the estimate itself: the engine's minimum host working set
within the budget, what spills to NVMe within the disk."""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from collections.abc import Callable, Sequence

from infinity.models.gpt import PRESETS, GPTConfig, count_params
from infinity.placement.estimate import COMPUTE_BYTES, TIERS
from infinity.placement.estimate_gpt import estimate_gpt
from infinity.placement.host_budget import working_set

__all__ = ["DEPTH_RANGE", "SHAPE_TEMPLATES", "host_floor_nbytes", "max_gpt"]

SHAPE_TEMPLATES = ("125m", "350m", "760m", "1.3b", "2.7b", "6.7b", "13b", "20b", "30b")
"""The presets whose shape (width, heads, sequence length) ``max_gpt`` scales by depth."""
DEPTH_RANGE = (0.5, 1.5)
"""A template's depth is scaled within these factors of its own, so the model keeps a preset's aspect ratio."""


def host_floor_nbytes(result: dict) -> int:
    """What host memory must hold for the run ``result`` (an :func:`estimate`) whatever the budget: the engine's
    minimum working set (:func:`~infinity.placement.host_budget.working_set`, the one rule for both) of gradient
    slices, compute shards and states that rest in host memory by the placement (not the ones the budget only lets
    stay there), two staging sets of the largest sub-group, the streaming buffers, and where the device is the host
    its buffers and the gathered parameters (the estimate's ``gathered_nbytes``). ``result``
    should be made with ``max_in_cpu=0`` and ``optimizer_max_in_cpu=0``, so no cache counts. Gradient slices the
    budget put on NVMe count as what they take in host memory (a few buffers, and a sub-group of them in each
    staging set)."""
    s, tiers = result["setting"], result["tiers"]
    cbytes = COMPUTE_BYTES[s["precision"]]
    host, device = tiers["host"], tiers["device"]
    largest_shard = math.ceil(s["largest_layer_params"] / s["world_size"])
    resting = sum(n for kind, n in host.items() if kind not in ("optimizer_staging", "step_undo"))
    staging_sets, staged_grad_itemsize = 0, 0
    if s["offload_optimizer"] == "nvme":
        staging_sets = 2
        if tiers["nvme"]["gradients"]:  # spilled slices are read back into each staging set
            lossless = s["gradient_accumulation_steps"] == 1 and s["precision"] != "fp16"
            staged_grad_itemsize = cbytes if lossless else 4
    else:
        resting += host["optimizer_staging"]
    if not s["gpu"]:  # device memory is host memory: its buffers charge the same budget
        resting += sum(n for kind, n in device.items() if kind not in ("gathered_params", "activations", "step_undo"))
    return working_set((("resting", resting),), staging_sets=staging_sets,
                       largest_sub_group_numel=result["largest_sub_group_numel"], largest_shard_numel=largest_shard,
                       state_dtype=s["state_dtype"], itemsize=cbytes, staged_grad_itemsize=staged_grad_itemsize,
                       gathered=result["gathered_nbytes"]).nbytes


def _nvme_need(result: dict) -> int:
    """NVMe bytes the run cannot do without (a speculative step's second side is taken only where there is room)."""
    return result["totals"]["nvme"] - result["tiers"]["nvme"]["step_undo"]


def max_gpt(*, host_memory_nbytes: int, nvme_nbytes: int, device_memory_nbytes: int | None = None,
            templates: Sequence[str] = SHAPE_TEMPLATES, micro_batch: int = 1, seq_len: int | None = None,
            decays: Callable[[GPTConfig], Sequence[float | None]] | None = None, **setting) -> dict:
    """The largest GPT of our presets' shape (a template preset's width, heads and sequence length, its depth
    scaled within :data:`DEPTH_RANGE`) whose run fits ``host_memory_nbytes`` of host memory (its floor,
    :func:`host_floor_nbytes`, within the budget: everything above the floor spills to NVMe) and
    ``nvme_nbytes`` of disk, and where given ``device_memory_nbytes`` of device memory (its accounted bytes and
    activations). ``setting``: :func:`estimate`'s keywords (offload tiers, precision, state dtype, gpu, ...);
    ``decays``: each parameter's weight decay for a config, where the run's param groups lay its sub-groups out
    by decay (``infinity train``'s), so that each depth is cut into sub-groups as the engine cuts it.

    Returns ``{"config", "template", "num_params", "bound", "host_floor_nbytes", "nvme_nbytes",
    "bytes_per_param", "estimate"}``: ``bytes_per_param`` is each tier's bytes over the parameter count under
    that budget, ``bound`` the resource the next depth up exceeds; ``config`` is None when nothing fits."""
    if host_memory_nbytes <= 0 or nvme_nbytes < 0:
        raise ValueError(f"max_gpt: host memory must be positive and disk room not negative, got "
                         f"{host_memory_nbytes} and {nvme_nbytes}")
    unknown = [t for t in templates if t not in PRESETS]
    if unknown:
        raise ValueError(f"max_gpt: unknown template preset(s) {', '.join(unknown)}; presets: {', '.join(PRESETS)}")
    planned_setting = dict(setting, host_memory_budget=host_memory_nbytes)
    floor_setting = dict(planned_setting, max_in_cpu=0, optimizer_max_in_cpu=0)
    best: dict | None = None

    def estimate_of(cfg: GPTConfig, kwargs: dict) -> dict:
        by_decay = {} if decays is None else {"param_decays": decays(cfg)}
        return estimate_gpt(cfg, micro_batch=micro_batch, seq_len=seq_len, **kwargs, **by_decay)

    def verdict(cfg: GPTConfig) -> str | None:
        """None when ``cfg`` fits, else the resource it exceeds."""
        if host_floor_nbytes(estimate_of(cfg, floor_setting)) > host_memory_nbytes:
            return "host memory"
        planned = estimate_of(cfg, planned_setting)
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
    planned, floor = estimate_of(best["config"], planned_setting), estimate_of(best["config"], floor_setting)
    n = best["num_params"]
    best.update(host_floor_nbytes=host_floor_nbytes(floor), nvme_nbytes=_nvme_need(planned), estimate=planned,
                bytes_per_param={t: {kind: nbytes / n for kind, nbytes in planned["tiers"][t].items() if nbytes}
                                 for t in TIERS})
    best["config"] = asdict(best["config"])
    return best
