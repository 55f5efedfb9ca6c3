"""The checks ``infinity train`` makes before any work: the config file reads as JSON, the NVMe folder is
writable and its disk has room for the swap files, and the machine has the memory the estimate says."""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from infinity.commands.train_signals import FOLDER_LOCK
from infinity.config.schema import InfinityConfig
from infinity.config.tier_names import OffloadDevice
from infinity.placement.report import format_bytes
from infinity.storage.lock_file import remove_if_unheld
from infinity.storage.swap_store import STALE_AFTER_S, direct_io_problem as by_filesystem, remove_dead_stores

__all__ = ["ROOM_CHECK_ENV", "TEMPORARY_SWAP_PATH", "nvme_offloads", "check_disk_room", "check_memory", "check_model_file", "check_nvme_room", "check_output_folder",
           "check_writable", "config_number", "finite_positive", "remove_dead_swap_folders",
           "SwapLocation", "check_direct_io", "default_swap_location", "direct_io_problem"]


def check_writable(path: str, what: str = "nvme path") -> None:
    """``OSError`` naming ``path`` unless a file can be created in it (created 0700, with its parents, if missing,
    as DeepSpeed does)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise NotADirectoryError(f"{what} {path!r} is not a folder")
    try:
        p.mkdir(mode=0o700, parents=True, exist_ok=True)
        probe = p / f".infinity-probe-{uuid.uuid4().hex}"
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
        probe.unlink()
    except OSError as err:
        raise PermissionError(f"{what} {path!r} is not writable: {err.strerror or err}") from None


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


TEMPORARY_SWAP_PATH = "<temporary folder>"
"""The ``nvme_path`` of an offload block whose swap folder the run makes (no --nvme-path, none in --config): a
stand-in while the plan is checked, replaced by the folder when the run starts."""
TEMPORARY_PREFIX = "infinity-train-"
"""The private swap folders ``infinity train`` makes in the temporary directory (removed at its exit), named
``infinity-train-<pid>-<random>`` so that a later run can tell a dead run's folder from a live one's."""


def remove_dead_swap_folders(parent: str) -> int:
    """Remove the swap stores under ``parent`` that dead runs left (the store's lock rule: no process holds them),
    and this command's private folders (``infinity-train-<pid>-*``) whose lock no process holds: a dead run's
    folder goes the moment it died. A folder without its lock file (being made, or an older run's) goes only once
    its pid is dead and it is older than ``STALE_AFTER_S``. How many went."""
    removed = remove_dead_stores(parent)
    for folder in Path(parent).glob(f"{TEMPORARY_PREFIX}*"):
        pid = folder.name[len(TEMPORARY_PREFIX):].split("-", 1)[0]
        try:
            if not folder.is_dir() or folder.is_symlink():
                continue
            lock = folder / FOLDER_LOCK
            if lock.exists():
                removed += remove_if_unheld(lock, folder)
                continue
            if not pid.isdigit() or psutil.pid_exists(int(pid)) or time.time() - folder.stat().st_mtime < STALE_AFTER_S:
                continue
            removed += remove_dead_stores(folder)
            folder.rmdir()  # only once empty: a live run's folder holds its locked store
            removed += 1
        except OSError:
            continue
    return removed


def nvme_offloads(config: InfinityConfig) -> list:
    """The offload blocks of ``config`` (``zero.offload_param``, ``zero.offload_optimizer``) that go to NVMe (the
    optimizer's ``auto`` with an ``nvme_path`` spills there)."""
    zero = config.zero
    return [b for b in (zero.offload_param, zero.offload_optimizer)
            if b.device == OffloadDevice.NVME or (b.device == OffloadDevice.AUTO and b.nvme_path)]


ROOM_CHECK_ENV = "INFINITY_NO_ROOM_CHECK"
"""Set to 1, ``infinity train`` skips :func:`check_nvme_room` (the estimate's bytes against the disk's room), so
the disk itself says whether a model fits: the engine's own reservations at start (swap keys laid out with
``posix_fallocate``) still fail before any step. For probing a disk's true limit (``bench_scale.py --above``),
where a refusal by the estimate would only repeat the estimate."""


def check_nvme_room(plan) -> None:
    """The estimate's NVMe bytes (for every rank on this machine) against the free room of the disk; the second
    side of a speculative step's states is left out: the engine takes it only where the disk has room for it
    (``SwappedStates.reserve_other_sides``), and steps overlap less without it. Skipped where
    :data:`ROOM_CHECK_ENV` is 1."""
    if os.environ.get(ROOM_CHECK_ENV) == "1":
        return
    temporary = plan.swap.parent if getattr(plan, "swap", None) else tempfile.gettempdir()
    paths = {temporary if b.nvme_path in (None, TEMPORARY_SWAP_PATH) else b.nvme_path
             for b in nvme_offloads(plan.config)}
    if not paths:
        return
    for where in sorted(paths):  # (each path is held to the whole amount: simple, and errs on the safe side)
        remove_dead_swap_folders(where)  # first: what a killed run left must not fail the room check
        needed = plan.estimate["totals"]["nvme"] - plan.estimate["tiers"]["nvme"]["step_undo"]
        check_disk_room(where, needed * plan.local_world_size)


def config_number(block: dict, key: str, where: str, *, integer: bool = True):
    """``block[key]`` when it is a JSON number (an integer if ``integer``), None when absent; else a ``ValueError``
    naming ``where``. "auto" is None too (the run fills it in); another string ("8") is refused here rather than
    failing later as a ``TypeError``."""
    value = block.get(key)
    if value is None or value == "auto":  # "auto" (Hugging Face's Trainer): filled from the run (infinity.config.auto)
        return None
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or (integer and isinstance(value, float) and not value.is_integer()):
        kind = "an integer" if integer else "a number"
        hint = " (a JSON number, without quotes)" if isinstance(value, str) else ""
        raise ValueError(f"config key {where} must be {kind}, got {value!r}{hint}")
    return int(value) if integer else float(value)


def finite_positive(name: str, value) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is a finite number above zero."""
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number above zero, got {value}")


def check_model_file(path: str) -> None:
    """A Python model file must compile: a syntax error is named with its line, before any work."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"model file {path!r} does not exist")
    if p.suffix != ".py":
        return
    try:
        compile(p.read_bytes(), str(p), "exec")
    except SyntaxError as err:
        raise ValueError(f"model file {path!r} has a syntax error at line {err.lineno}: {err.msg}") from None
    except ValueError as err:  # (null bytes)
        raise ValueError(f"model file {path!r} is not Python source: {err}") from None


def check_output_folder(flag: str, path: str) -> None:
    """The folder that a file given to ``flag`` goes into must exist: checked before work, not after it."""
    folder = Path(path).parent
    if not folder.is_dir():
        raise FileNotFoundError(f"{flag} {path!r}: folder {str(folder)!r} does not exist")


def direct_io_problem(path: str) -> str | None:
    """Why the folder ``path`` does not take O_DIRECT (tmpfs, a filesystem that refuses it), or None: the
    filesystem's type, then one aligned O_DIRECT write of a probe file."""
    import mmap

    problem = by_filesystem(path)
    if problem is not None or not hasattr(os, "O_DIRECT"):
        return problem
    probe = Path(path) / f".infinity-direct-{uuid.uuid4().hex}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as err:
        return f"the filesystem refuses O_DIRECT ({err.strerror})"
    try:
        buf = mmap.mmap(-1, 4096)  # page-aligned
        os.write(fd, buf)
    except OSError as err:
        return f"an aligned O_DIRECT write failed ({err.strerror})"
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
    return None


def check_direct_io(path: str, buffered_ok: bool) -> None:
    """A swap folder given by the user must take O_DIRECT, unless buffered I/O was asked for (then it is said)."""
    problem = direct_io_problem(path)
    if problem is None:
        return
    if not buffered_ok:
        raise OSError(f"nvme path {path!r} does not take direct I/O: {problem}; put the swap on a disk, or give "
                      f"--buffered-io (config aio.buffered_fallback: true) to swap through the page cache there")
    print(f"infinity train: warning: nvme path {path!r} does not take direct I/O ({problem}); swapping through the "
          f"page cache (--buffered-io): the swap files take memory, not only disk", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class SwapLocation:
    """Where the private temporary swap folder goes when no --nvme-path is given."""

    parent: str
    """The folder it is made in: the temporary directory, or the first of ``FALLBACK_PARENTS`` that takes O_DIRECT."""
    buffered: bool
    """No candidate takes O_DIRECT: buffered I/O in the temporary directory (said loudly)."""
    note: str = ""
    """Why it is not the temporary directory; empty when it is."""


def _fallback_parents() -> list[str]:
    return ["/var/tmp", str(Path.home() / ".cache" / "infinity")]


def default_swap_location(buffered_ok: bool = False) -> SwapLocation:
    """The temporary directory if it takes O_DIRECT; else the first fallback folder that does; else the temporary
    directory with buffered I/O (tmpfs /tmp on a machine with no other writable disk)."""
    tmp = tempfile.gettempdir()
    problem = direct_io_problem(tmp)
    if problem is None:
        return SwapLocation(tmp, buffered=False)
    for parent in _fallback_parents():
        try:
            Path(parent).mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(parent, os.W_OK) and direct_io_problem(parent) is None:
            return SwapLocation(parent, buffered=False, note=f"{tmp} does not take direct I/O ({problem}): the swap "
                                                             f"folder goes in {parent} (or give --nvme-path)")
    return SwapLocation(tmp, buffered=True, note=(
        f"WARNING: {tmp} does not take direct I/O ({problem}) and no other folder found does "
        f"({', '.join(_fallback_parents())}): swapping through the page cache in {tmp}, so the swap takes memory; "
        f"give --nvme-path on a disk"))
