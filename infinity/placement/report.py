"""The estimate as a person reads it: counts and sizes parsed and printed, the per-tier table of
``infinity estimate``."""

from __future__ import annotations

import re
from typing import Sequence

from infinity.kernels.compact import checkpoint_bytes_per_element
from infinity.placement.estimate import KINDS, TIERS

__all__ = ["format_bytes", "format_max_gpt", "format_table", "parse_count"]

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
        f"{s['num_params']:,} parameters"
        + (f" ({s['trainable_params']:,} trainable)" if s.get("trainable_params", s["num_params"]) < s["num_params"]
           else "")
        + f", world size {s['world_size']}, {s['precision']}; "
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
            f"at {checkpoint_bytes_per_element(s['state_dtype'])} B an element, plus the compute shard)"
            + (f"; {format_bytes(chosen['checkpoint_nbytes'] - chosen['checkpoint_frozen_nbytes'])} without the "
               f"frozen parameters" if chosen.get("checkpoint_frozen_nbytes") else ""),
            "",
            "alternatives (offload_param / offload_optimizer; * = requested):",
            _table(["setting", *TIERS], alt_rows),
        ]
    )


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


def format_optimizer_split(states: dict) -> str:
    """Where the optimizer's states rest, ``{tier: {"sub_groups": n, "nbytes": b}}`` (``step_metrics()``'
    ``optimizer_states``), as one line: ``optimizer states: device 3 sub-groups 1.2 GB, host ...``."""
    parts = [f"{tier} {where['sub_groups']} sub-group{'s' if where['sub_groups'] != 1 else ''} "
             f"{format_bytes(where['nbytes'])}" for tier, where in states.items() if where["sub_groups"]]
    return "optimizer states: " + ", ".join(parts)


def format_split_choice(split: dict) -> str:
    """How a split's count was chosen (``step_metrics()["optimizer_split"]`` or the estimate's ``optimizer_split``),
    as one clause: the step-time model's predicted step of the chosen count against every sub-group offloaded, or
    the rule that chose without it."""
    chosen_by = split.get("chosen_by")
    if chosen_by == "step-time model":
        return (f"chosen by the step-time model among 0-{split['fitting_sub_groups']} sub-groups that fit the "
                f"device budget: predicted step {split['predicted_step_s']:.3g} s against "
                f"{split['all_offloaded_step_s']:.3g} s with every sub-group offloaded (bound by {split['bound_by']})")
    if chosen_by == "offload_optimizer.ratio":
        return "chosen by offload_optimizer.ratio"
    return (f"the longest run of first sub-groups within zero_optimization.device_memory_budget "
            f"({split.get('fitting_sub_groups')}; no machine figures for the step-time model)")


def format_device_budget(split: dict) -> str:
    """``step_metrics()["optimizer_split"]``'s device budget and the bytes its share holds, as one clause."""
    budget = split.get("budget_nbytes")
    held = format_bytes(split["device_share_nbytes"])
    if budget is None:
        return f"device optimizer share {held} (no device budget)"
    return f"device optimizer share {held} of zero_optimization.device_memory_budget {format_bytes(budget)}"


def format_estimated_split(est: dict) -> str | None:
    """The estimate's split optimizer as one line (None without a split)."""
    split = est.get("optimizer_split")
    if split is None:
        return None
    nbytes = split["nbytes"]
    return (f"optimizer split: {split['device_sub_groups']} of {split['sub_groups']} sub-groups on the device "
            f"({format_bytes(nbytes['device'])} of states), the rest offloaded (host {format_bytes(nbytes['host'])}, "
            f"nvme {format_bytes(nbytes['nvme'])}); {format_split_choice(split)}")
