"""The host cores the fused CPU Adam runs on, so its threads do not fight the thread that feeds the GPU.

On a GPU the main thread runs the model's Python, launches its kernels and issues the copies and reads that feed
it. A CPU kernel whose OpenMP team takes every core preempts it, and the GPU idles until the launch comes. So with
a CUDA device the kernel's team takes every core this process may use but the first ``FEEDER_CORES``, and its
threads are bound to those cores: the engine's worker threads that update sub-groups (the overlapped step's, the
step tail's, the host gradient adder's) bind themselves before their first update (:meth:`HostCores.bind_this_thread`),
and the threads OpenMP starts for them inherit the binding (Linux gives a new thread its creator's affinity). The
main thread is not bound: with its core left free, the scheduler runs it there.

Several ranks on one machine (``LOCAL_WORLD_SIZE``, as ``torchrun`` sets it, with ``LOCAL_RANK``) share its cores:
each takes its own contiguous share of them, and leaves the first core of its share to its own feeder, so no two
ranks' teams run on one core (torchrun's ``OMP_NUM_THREADS=1`` would give every rank's CPU Adam one thread). Where
the launcher has bound each rank to its share already (:data:`RANK_BOUND_ENV`), the process's cores are that share.

On a CPU device the cores are the device: forward, backward and the kernel share them, so the team takes torch's
thread count, unbound. ``zero_optimization.offload_optimizer.host_threads`` sizes the team by hand; fewer threads
than the rank's cores are bound to the last of them, leaving the first to the threads that feed the device.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from infinity.runtime.comm import local_rank_and_size

__all__ = ["FEEDER_CORES", "HOST_THREADS_KEY", "RANK_BOUND_ENV", "HostCores", "cores_named", "plan_host_cores",
           "rank_share", "usable_cores"]

logger = logging.getLogger(__name__)

FEEDER_CORES = 1
"""Cores left to the main thread on a GPU machine: it launches the GPU's kernels and issues its copies."""
HOST_THREADS_KEY = "zero_optimization.offload_optimizer.host_threads"
RANK_BOUND_ENV = "INFINITY_RANK_CORES_BOUND"
"""Set (to 1) where the launcher bound each rank of this machine to its own share of the cores
(``infinity deepspeed --bind_cores_to_rank``): the process's cores are its rank's already, not shared again."""


def usable_cores() -> frozenset[int]:
    """The cores this process may run on (its affinity: taskset, cgroups), or all of ``os.cpu_count()``."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


@dataclass(frozen=True, slots=True)
class HostCores:
    """The fused CPU Adam's team: how many threads, and the cores they are bound to."""

    threads: int | None
    """The kernel's team size (its ``num_threads``); None: torch's thread count (``torch.set_num_threads``)."""
    cores: frozenset[int] | None
    """The cores the engine's updating threads bind to, or None: unbound (they run wherever the process may)."""
    reason: str
    """A few words for the start line: why this team."""

    def bind_this_thread(self) -> None:
        """Bind the calling thread (and the OpenMP threads it starts from now on) to :attr:`cores`; nothing when
        unbound. Only the engine's own worker threads call this: the main thread is the user's."""
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores)  # pid 0: the calling thread alone

    def describe(self) -> str:
        """``15 threads on cores 1-15 (why)``, or ``torch's 2 threads, unbound (why)``."""
        if self.threads is None:
            count = torch.get_num_threads()
            return f"torch's {count} thread{'s' if count != 1 else ''}, unbound ({self.reason})"
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        if self.cores is None:
            return f"{threads}, unbound ({self.reason})"
        return f"{threads} on core{'s' if len(self.cores) != 1 else ''} {_ranges(self.cores)} ({self.reason})"


def plan_host_cores(device: torch.device, requested: int | None, *, usable: frozenset[int] | None = None,
                    local_rank: int | None = None, local_world_size: int | None = None) -> HostCores:
    """The team for a run on ``device`` with ``offload_optimizer.host_threads`` = ``requested`` (None: from the
    machine). ``usable``: the process's cores (default :func:`usable_cores`); ``local_rank`` of
    ``local_world_size`` ranks on this machine (default: ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, else 0 of 1)
    take the ``local_rank``-th of as many contiguous shares of them. Raises ``ValueError`` naming the key for a
    count this rank has no cores for."""
    usable = usable_cores() if usable is None else usable
    ordered = rank_share(sorted(usable), *_local_ranks(local_rank, local_world_size))
    if requested is not None:
        if requested > len(ordered):
            raise ValueError(f"config key {HOST_THREADS_KEY} is {requested}, but this rank may run on "
                             f"{len(ordered)} cores ({_ranges(ordered)})")
        if requested == len(usable):  # the process's every core: nothing to leave free, nobody to share with
            return HostCores(requested, None, HOST_THREADS_KEY)
        return HostCores(requested, frozenset(ordered[-requested:]), HOST_THREADS_KEY)
    if device.type != "cuda" or len(ordered) <= FEEDER_CORES:
        why = "the cores are the device" if device.type != "cuda" else "no core to spare for the GPU's feeder"
        return HostCores(None, None, why)
    kept = frozenset(ordered[FEEDER_CORES:])
    return HostCores(len(kept), kept, f"core {_ranges(ordered[:FEEDER_CORES])} left to the thread that feeds the GPU")


def _local_ranks(local_rank: int | None, local_world_size: int | None) -> tuple[int, int]:
    """(this rank's index, the ranks) on this machine: as given, else torchrun's environment, else (0, 1)."""
    if local_rank is not None or local_world_size is not None:
        rank, size = local_rank or 0, local_world_size or 1
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"local rank {rank} of {size} ranks on this machine")
        return rank, size
    if os.environ.get(RANK_BOUND_ENV) == "1":
        return 0, 1  # the launcher gave this rank its own cores: its affinity is its share
    return local_rank_and_size()


def rank_share(ordered: list[int], rank: int, size: int) -> list[int]:
    """The ``rank``-th of ``size`` contiguous, near-equal shares of ``ordered`` (every core where there are fewer
    cores than ranks: they are shared anyway)."""
    if size <= 1 or len(ordered) < size:
        return ordered
    per, extra = divmod(len(ordered), size)
    start = rank * per + min(rank, extra)
    return ordered[start:start + per + (1 if rank < extra else 0)]


def cores_named(text: str) -> list[int]:
    """The cores of a list such as ``0,2-5`` (numactl's and DeepSpeed's form), in order, each once. Raises
    ``ValueError`` naming the part that is not a core or a range of cores."""
    cores: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            span = range(int(first), int(last if dash else first) + 1)
        except ValueError:
            raise ValueError(f"{text!r}: {part!r} is not a core or a range of cores (such as 0,2-5)") from None
        if not span or span.start < 0:
            raise ValueError(f"{text!r}: {part!r} names no core")
        cores.extend(core for core in span if core not in cores)
    return cores


def _ranges(cores) -> str:
    """``0-3,8,10-11``."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
