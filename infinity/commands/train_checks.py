"""The checks ``infinity train`` makes before any work: the config file reads as JSON, the NVMe folder is
writable and its disk has room for the swap files, and the machine has the memory the estimate says."""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from pathlib import Path

from infinity.estimate import format_bytes

__all__ = ["check_disk_room", "check_memory", "check_nvme_room", "check_writable", "read_config_file"]


def read_config_file(path: str) -> dict:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path!r} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"config file {path!r} is a folder, not a JSON file") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"config file {path!r} is not JSON: {err}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"config file {path!r} is not JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path!r} must hold a JSON object, got {type(raw).__name__}")
    return raw


def check_writable(path: str) -> None:
    """``OSError`` naming ``path`` unless a file can be created in it (created, with its parents, if missing)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise NotADirectoryError(f"nvme path {path!r} is not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".infinity-probe-{uuid.uuid4().hex}"
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
        probe.unlink()
    except OSError as err:
        raise PermissionError(f"nvme path {path!r} is not writable: {err.strerror or err}") from None


def check_memory(plan) -> None:
    """``ValueError`` when the estimate's memory (host; and device, on a CPU-only machine) for every rank on
    this machine is more than the memory available, so the run fails with a reason instead of being killed."""
    import psutil
    import torch

    totals = plan.estimate["totals"]
    per_rank = totals["host"] + (0 if torch.cuda.is_available() else totals["device"])
    needed = per_rank * plan.local_world_size
    available = psutil.virtual_memory().available
    if needed > available:
        raise ValueError(
            f"this run needs about {format_bytes(needed)} of memory ({format_bytes(per_rank)} per rank x "
            f"{plan.local_world_size}) but {format_bytes(available)} is available; offload more "
            f"(--offload-param/--offload-optimizer nvme), lower --micro-batch or --seq-len, or lower "
            f"zero_optimization.sub_group_size / stage3_max_live_parameters in --config"
        )


def check_disk_room(path: str, needed_nbytes: int) -> None:
    """``OSError`` naming both numbers when the disk under ``path`` has less free room than ``needed_nbytes``."""
    free = shutil.disk_usage(path).free
    if needed_nbytes > free:
        raise OSError(
            f"not enough room on the disk of nvme path {path!r}: the swap files need about "
            f"{format_bytes(needed_nbytes)} ({needed_nbytes:,} bytes) but {format_bytes(free)} ({free:,} bytes) are free"
        )


def check_nvme_room(plan) -> None:
    """The estimate's NVMe bytes (for every rank on this machine) against the free room of the disk."""
    if "nvme" not in (plan.offload_param, plan.offload_optimizer):
        return
    zero = plan.ds_config["zero_optimization"]
    paths = {zero[k].get("nvme_path") or tempfile.gettempdir()
             for k in ("offload_param", "offload_optimizer") if zero[k]["device"] == "nvme"}
    for where in sorted(paths):  # (each path is held to the whole amount: simple, and errs on the safe side)
        check_disk_room(where, plan.estimate["totals"]["nvme"] * plan.local_world_size)
