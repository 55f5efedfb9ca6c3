"""One host-memory budget for everything the engine allocates in host memory.

The budget (``zero_optimization.host_memory_budget``: bytes, or a fraction of
the memory available at start; by default :data:`DEFAULT_FRACTION` of it) is
enforced by the tiers' accounting: host buffers, pinned or not, and — where
device memory is host memory — device buffers all charge it, and an
allocation past it fails. Within it, the engine plans in this order:

1. the minimum working set: gradient slices, states that rest in memory (the
   persistent parameters' shards too, where the others are on NVMe), two
   staging sets, the largest gathered module (where the device is the host),
   and a reserve for transient buffers (checkpoint and state-dict streaming).
   A budget below it is refused before any work, naming what to change;
2. staging: sized from the budget and the largest shard, whatever
   ``sub_group_size`` and ``buffer_count`` say (staging beyond
   :data:`MAX_STAGED_SUB_GROUP_NUMEL` elements a set buys no bandwidth);
3. with NVMe configured, compute shards and then optimizer sub-groups stay in
   host memory while they fit; only the rest spills to NVMe.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch

from infinity.config.sections import ZeroConfig
from infinity.kernels import state_bytes_per_element, state_nbytes as nbytes
from infinity.placement.layout import packed_offsets
from infinity.placement.placement import RING_SLICES, GradRoute
from infinity.storage.stats import format_nbytes

logger = logging.getLogger(__name__)

DEFAULT_FRACTION = 0.8
"""Without a setting, the budget is this share of the memory available at start (split between local ranks)."""

MAX_STAGED_SUB_GROUP_NUMEL = 100_000_000
"""Elements per staging set beyond which NVMe staging buys no bandwidth (1.4 GB a set, ~0.7 s at 2 GB/s)."""

STATE_BYTES = 12
"""fp32 master and both moments, per element (``state_dtype`` fp32; :func:`state_nbytes` for any)."""

def state_nbytes(state_dtype: str, numel: int) -> int:
    """Bytes of the optimizer states of ``numel`` elements in ``state_dtype`` (12, 6 or ~4.03 an element)."""
    return nbytes(state_dtype, numel)


def state_bytes_per_numel(state_dtype: str) -> int:
    """Whole bytes an element of optimizer states, rounded up (planning in integers): 12, 6 or 5."""
    return math.ceil(state_bytes_per_element(state_dtype))


def resolve_host_budget(setting: int | float | None, *, available_nbytes: int | None = None,
                        local_ranks: int | None = None) -> int:
    """The budget in bytes for this rank: a fraction (or the default) is of the memory available now, shared
    by the ranks on this machine; bytes are this rank's own."""
    if isinstance(setting, int):
        return setting
    if available_nbytes is None:
        import psutil
        available_nbytes = psutil.virtual_memory().available
    if local_ranks is None:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    fraction = DEFAULT_FRACTION if setting is None else setting
    return int(available_nbytes * fraction) // local_ranks


def staged_sub_group_numel(sub_group_size: int, *, largest_shard_numel: int, budget_nbytes: int, sets: int,
                           bytes_per_numel: int) -> int:
    """Elements per sub-group when the optimizer stages its states from NVMe: at most a quarter of the budget
    for all staging sets and at most :data:`MAX_STAGED_SUB_GROUP_NUMEL`, never below the largest shard (a
    sub-group holds whole shards)."""
    by_budget = budget_nbytes // (4 * sets * bytes_per_numel)
    return max(largest_shard_numel, min(sub_group_size, MAX_STAGED_SUB_GROUP_NUMEL, by_budget))


@dataclass(frozen=True, slots=True)
class WorkingSet:
    """The bytes of host memory a run cannot do without, by kind."""

    parts: tuple[tuple[str, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.parts)

    def describe(self) -> str:
        return ", ".join(f"{name} {_format(n)}" for name, n in self.parts if n)


def check_budget(budget_nbytes: int, minimum: WorkingSet, *, key: str = "zero_optimization.host_memory_budget") -> None:
    """``ValueError`` naming the budget, the minimum and what to change, before any work."""
    if budget_nbytes >= minimum.nbytes:
        return
    raise ValueError(
        f"{key} is {_format(budget_nbytes)}, but this run needs at least {_format(minimum.nbytes)} of host memory "
        f"({minimum.describe()}); raise the budget (--host-memory), offload more to nvme, use more ranks, or "
        f"lower gradient_accumulation_steps (fp32 gradient slices take twice the bytes of bf16 ones)")


def transient_reserve_nbytes(largest_sub_group_numel: int, largest_shard_numel: int, compute_itemsize: int) -> int:
    """Buffers made for a moment (checkpoint and full-state-dict streaming: two sub-groups of fp32, two
    shards in compute precision), kept out of what the planner hands to resting states."""
    return 2 * largest_sub_group_numel * 4 + 2 * largest_shard_numel * compute_itemsize


def resident_prefix_numel(shard_numels: list[int], room_nbytes: int, itemsize: int) -> int:
    """Elements of the first shards (in order) that fit in ``room_nbytes``."""
    total = 0
    for numel in shard_numels:
        if (total + numel) * itemsize > room_nbytes:
            break
        total += numel
    return total


class HostMemoryPlan:
    """How one engine uses its budget, decided before anything is allocated: the sub-group size and the
    staging sets, the minimum working set (refused when it does not fit), the reserve kept for buffers made
    later, and the compute shards kept in host memory. Optimizer sub-groups take what is left (the optimizer
    measures it once its staging is allocated)."""

    def __init__(self, zero: ZeroConfig, compute_dtype: torch.dtype):
        """``zero``: the config's ``zero_optimization`` section, whose ``host_memory_budget`` is resolved here."""
        self.zero = zero
        self.budget_nbytes = resolve_host_budget(zero.host_memory_budget)
        self.itemsize = torch.empty((), dtype=compute_dtype).element_size()
        self.state_dtype = zero.offload_optimizer.state_dtype
        self.layout = self.placement = None
        self.staging_sets = self._configured_staging_sets()

    def sub_group_size(self, named_params: list, world_size: int) -> int:
        """``sub_group_size``, capped where sub-groups are staged from NVMe so staging fits the budget."""
        zero = self.zero
        if zero.offload_optimizer.offloaded_tier != "nvme":
            return zero.sub_group_size
        largest_shard = max((math.ceil(p.numel() / world_size) for _, p in named_params), default=0)
        size = staged_sub_group_numel(zero.sub_group_size, largest_shard_numel=largest_shard,
                                      budget_nbytes=self.budget_nbytes, sets=self.staging_sets,
                                      bytes_per_numel=state_bytes_per_numel(self.state_dtype) + self.itemsize)
        if size < zero.sub_group_size:
            logger.info("sub_group_size %d -> %d: %d NVMe staging sets of that size fit the host-memory budget "
                        "of %s (staging more buys no bandwidth)", zero.sub_group_size, size, self.staging_sets,
                        _format(self.budget_nbytes))
        return size

    def settle(self, layout, placement) -> None:
        """With the layout and the placement known: refuse a budget below the minimum working set, and take
        fewer staging sets (down to two) where the budget is tight."""
        self.layout, self.placement = layout, placement
        check_budget(self.budget_nbytes, self.minimum_working_set())
        configured = self.staging_sets
        if placement.master.tier == "nvme":
            while self.staging_sets > 2 and self.minimum_working_set(self.staging_sets).nbytes > self.budget_nbytes:
                self.staging_sets -= 1
        if self.staging_sets < configured:
            logger.info("offload_optimizer.buffer_count %d -> %d: what the host-memory budget of %s holds",
                        configured, self.staging_sets, _format(self.budget_nbytes))

    def minimum_working_set(self, staging_sets: int = 2) -> WorkingSet:
        """What host memory must hold whatever the budget."""
        layout, placement, itemsize = self.layout, self.placement, self.itemsize
        charged = {"host"} if placement.distinct else {"host", "device"}  # tiers that are host memory here
        grad_bytes = itemsize if placement.grads_lossless else 4
        # a split optimizer's device sub-groups (gradients and states) are host memory only where the device is
        offloaded_numel = layout.trainable_numel - placement.device_numel
        device_numel = placement.device_numel if "device" in charged else 0
        grads = (offloaded_numel * grad_bytes if placement.grads.tier in charged else 0) + device_numel * grad_bytes
        if placement.compute_shard.tier in charged:
            shards = layout.total_numel * itemsize
        elif placement.compute_shard.tier == "nvme":  # persistent shards rest in host memory all the same
            persistent = layout.persistent_slots(self.zero.param_persistence_threshold)
            shards = packed_offsets([s.shard_numel for s in layout.slots if s.index in persistent])[1] * itemsize
        else:
            shards = 0
        states = ((state_nbytes(self.state_dtype, offloaded_numel) if placement.master.tier in charged else 0)
                  + state_nbytes(self.state_dtype, device_numel))
        staging = 0
        if placement.master.tier == "nvme":
            largest = layout.largest_sub_group_numel
            staging = staging_sets * (state_nbytes(self.state_dtype, largest) + largest * itemsize)
        gathered = 0 if placement.distinct else 2 * layout.largest_shard_numel * layout.world_size * itemsize
        reserve = transient_reserve_nbytes(layout.largest_sub_group_numel, layout.largest_shard_numel, itemsize)
        return WorkingSet((("gradient slices", grads), ("compute shards", shards), ("optimizer states", states),
                           (f"{staging_sets} staging sets", staging), ("gathered parameters", gathered),
                           ("streaming buffers", reserve)))

    def reserve_nbytes(self, read_pool_nbytes: int = 0) -> int:
        """Host memory kept free for buffers made later or for a moment: what the planner never hands to
        resting states (gathered parameters where the device is the host, scratch, read buffers, the gradient
        ring, streaming)."""
        parts = dict(self.minimum_working_set().parts)
        scratch = self.layout.largest_sub_group_numel * self.itemsize
        ring = 0
        if self.placement.grad_route is GradRoute.HOST_RING:
            ring = RING_SLICES * self.layout.largest_shard_numel * self.itemsize
        return parts["gathered parameters"] + parts["streaming buffers"] + scratch + read_pool_nbytes + ring

    def param_cache_numel(self, room_nbytes: int | None, reserve_nbytes: int) -> int:
        """``offload_param.max_in_cpu``, within the budget: compute shards on NVMe are kept in host memory
        first (each byte kept saves 3 bytes of I/O a step, against 2 for optimizer states), after what the
        gradients, the optimizer and the reserve will need."""
        configured = self.zero.offload_param.max_in_cpu
        if self.placement.compute_shard.tier != "nvme" or room_nbytes is None:
            return configured
        parts = dict(self.minimum_working_set(self.staging_sets).parts)
        later = sum(n for name, n in parts.items() if name in ("gradient slices", "compute shards", "optimizer states")
                    or name.endswith("staging sets"))
        fits = max(0, room_nbytes - later - reserve_nbytes) // self.itemsize
        if fits < configured:
            logger.info("offload_param.max_in_cpu %d -> %d: what the host-memory budget leaves", configured, fits)
        return min(configured, fits)

    def _configured_staging_sets(self) -> int:
        optimizer = self.zero.offload_optimizer
        return max(2, optimizer.buffer_count) if optimizer.pipeline_read or optimizer.pipeline_write else 1


def _format(nbytes: int) -> str:
    return format_nbytes(nbytes)
