"""One host-memory budget for everything the engine allocates in host memory.

The budget (``zero_optimization.host_memory_budget``: bytes, or a fraction of
the memory available at start; by default :data:`DEFAULT_FRACTION` of it) is
enforced by the tiers' accounting: host buffers, pinned or not, and — where
device memory is host memory — device buffers all charge it, and an
allocation past it fails. Within it, the engine plans in this order:

1. the minimum working set (:func:`working_set`, the one rule the estimate and
   ``max_gpt`` count by too): gradient slices, states that rest in memory (the
   persistent parameters' shards too, where the others are on NVMe), two
   staging sets, the gathered parameters where the device is the host
   (:func:`gathered_nbytes`: every persistent one, and the largest module's
   fetch twice), and a reserve for transient buffers (checkpoint and
   state-dict streaming).
   Where it does not fit beside the reserve kept free (below) and the optimizer's
   states are on NVMe, the gradient slices of as few of the last sub-groups as
   make it fit rest on NVMe between backward and the step (:attr:`Placement.nvme_grads_from`; 2 bytes an element
   written and read a step for bf16 slices, and a small pool of buffers instead of
   the slices). A budget below the smallest working set is refused before any
   work, naming what to change;
2. staging: sized from the budget and the largest shard, whatever
   ``sub_group_size`` and ``buffer_count`` say (staging beyond
   :data:`MAX_STAGED_SUB_GROUP_NUMEL` elements a set buys no bandwidth);
3. with NVMe configured, compute shards and then optimizer sub-groups stay in
   host memory while they fit; only the rest spills to NVMe. What they may take
   leaves free what is allocated after them (:meth:`HostMemoryPlan.reserve_nbytes`:
   the gathered parameters, scratch, streaming, read buffers), so a run the
   plan accepts does not run out of its budget mid-step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch

from infinity.config.sections import ZeroConfig
from infinity.kernels import state_bytes_per_element, state_nbytes as nbytes
from infinity.placement.layout import packed_offsets
from infinity.placement.placement import RING_SLICES, GradRoute, Placement
from infinity.runtime.comm import local_rank_and_size
from infinity.storage.stats import format_nbytes

logger = logging.getLogger(__name__)

DEFAULT_FRACTION = 0.8
"""Without a setting, the budget is this share of the memory available at start (split between local ranks)."""

MAX_STAGED_SUB_GROUP_NUMEL = 100_000_000
"""Elements per staging set beyond which NVMe staging buys no bandwidth (1.4 GB a set, ~0.7 s at 2 GB/s)."""

STATE_BYTES = 12
"""fp32 master and both moments, per element (``state_dtype`` fp32; :func:`state_nbytes` for any)."""

GRAD_SPILL_SLICES = 2
"""Buffers of the largest spilled shard the gradient spill passes slices through (:mod:`infinity.grads.spill`): backward
waits only when the disk is that far behind."""


def spill_pool_nbytes(largest_shard_numel: int, grad_itemsize: int, *, accumulates: bool) -> int:
    """Host memory the gradient spill takes: its buffers, and where slices accumulate (fp32 slices: several
    micro-batches, or fp16) the buffer partial sums are read back into."""
    return (GRAD_SPILL_SLICES + (1 if accumulates else 0)) * largest_shard_numel * grad_itemsize


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
        local_ranks = local_rank_and_size()[1]
    fraction = DEFAULT_FRACTION if setting is None else setting
    return int(available_nbytes * fraction) // local_ranks


def staged_sub_group_numel(sub_group_size: int, *, largest_shard_numel: int, budget_nbytes: int, sets: int,
                           bytes_per_numel: int) -> int:
    """Elements per sub-group when the optimizer stages its states from NVMe: at most a quarter of the budget
    for all staging sets and at most :data:`MAX_STAGED_SUB_GROUP_NUMEL`, never below the largest shard (a
    sub-group holds whole shards)."""
    by_budget = budget_nbytes // (4 * sets * bytes_per_numel)
    return max(largest_shard_numel, min(sub_group_size, MAX_STAGED_SUB_GROUP_NUMEL, by_budget))


def gathered_nbytes(persistent_numel: int, largest_fetch_numel: int, itemsize: int) -> int:
    """Bytes of full parameters gathered at once, where device memory is host memory (the engine's plan, the
    estimate and ``max_gpt`` all count by this): every persistent parameter (gathered from its first use until the
    step; ``persistent_numel`` padded elements), and the largest module's fetch (``largest_fetch_numel``: a module's
    parameters are fetched together) twice: the module in use, and the next one fetched before its release (in
    backward a residual reaches a module's outputs before the module after it is done). Prefetches and parameters
    kept for reuse are taken only from room beyond the reserve (:meth:`HostMemoryPlan.reserve_nbytes`)."""
    return (persistent_numel + 2 * largest_fetch_numel) * itemsize


def working_set(resting: tuple[tuple[str, int], ...], *, staging_sets: int, largest_sub_group_numel: int,
                largest_shard_numel: int, state_dtype: str, itemsize: int, staged_grad_itemsize: int = 0,
                gathered: int = 0) -> "WorkingSet":
    """The minimum working set, the one rule for the engine (:meth:`HostMemoryPlan.minimum_working_set`), the
    estimate's spill decision and ``max_gpt``'s floor: the ``resting`` parts (gradient slices, compute shards,
    optimizer states that rest in host memory, by kind), ``staging_sets`` sets of the largest sub-group's states
    and compute shards (and its gradient slices read back from NVMe: ``staged_grad_itemsize`` bytes an element),
    the ``gathered`` parameters (:func:`gathered_nbytes`, where device memory is host memory) and the streaming
    buffers (:func:`transient_reserve_nbytes`)."""
    largest = largest_sub_group_numel
    staging = staging_sets * (state_nbytes(state_dtype, largest) + largest * (itemsize + staged_grad_itemsize))
    return WorkingSet((*resting, (f"{staging_sets} staging sets", staging), ("gathered parameters", gathered),
                       ("streaming buffers", transient_reserve_nbytes(largest, largest_shard_numel, itemsize))))


def kept_free_nbytes(minimum: "WorkingSet", *, scratch_nbytes: int, read_pool_nbytes: int = 0,
                     ring_nbytes: int = 0) -> int:
    """Host memory the planner never hands to resting states (compute shards and optimizer sub-groups kept in host
    memory, the undo copy of a speculative step), for buffers made after it measures its room: the ``minimum``'s
    gathered parameters and streaming buffers, a sub-group of scratch, the parameters' read buffers and the
    gradient ring. The engine (:meth:`HostMemoryPlan.reserve_nbytes`) and the estimate keep the same free."""
    parts = dict(minimum.parts)
    return parts["gathered parameters"] + parts["streaming buffers"] + scratch_nbytes + read_pool_nbytes + ring_nbytes


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

    def settle(self, layout, placement: Placement) -> Placement:
        """With the layout and the placement known: put the gradient slices the budget cannot hold on NVMe,
        refuse a budget below the minimum working set, and take fewer staging sets (down to two) where the budget
        is tight. Returns the placement, with :attr:`~Placement.nvme_grads_from` set where slices rest on NVMe."""
        self.layout, self.placement = layout, placement
        self.placement = self._spill_gradients()
        check_budget(self.budget_nbytes, self.minimum_working_set())
        configured = self.staging_sets
        if placement.master.tier == "nvme":
            while self.staging_sets > 2 and self.minimum_working_set(self.staging_sets).nbytes > self.budget_nbytes:
                self.staging_sets -= 1
        if self.staging_sets < configured:
            logger.info("offload_optimizer.buffer_count %d -> %d: what the host-memory budget of %s holds",
                        configured, self.staging_sets, _format(self.budget_nbytes))
        minimum = self.minimum_working_set(self.staging_sets)
        logger.info("host-memory budget %s: minimum working set %s (%s)", _format(self.budget_nbytes),
                    _format(minimum.nbytes), minimum.describe())
        return self.placement

    def _spill_gradients(self) -> Placement:
        """The placement with the fewest last sub-groups' gradient slices on NVMe that leaves the reserve free
        beside the minimum working set, as the states kept in host memory must (all the offloaded ones when none
        does: the error then names the smallest); as it was when everything fits, or where the slices cannot go
        to NVMe (states not there)."""
        placement, layout = self.placement, self.layout
        if (self._with_reserve_nbytes() <= self.budget_nbytes or placement.master.tier != "nvme"
                or placement.grads.tier != "host" or not layout.sub_groups):
            return placement
        first_offloaded = placement.device_sub_groups
        candidate = placement
        for first in range(len(layout.sub_groups) - 1, first_offloaded - 1, -1):
            self.placement = candidate = dataclasses.replace(placement, nvme_grads_from=first)
            if self._with_reserve_nbytes() <= self.budget_nbytes:
                break
        spilled = layout.trainable_numel - layout.sub_groups[candidate.nvme_grads_from].start
        logger.info("gradient slices of sub-groups %d-%d (%d elements) rest on NVMe between backward and the step: "
                    "the host-memory budget of %s cannot hold them", candidate.nvme_grads_from,
                    len(layout.sub_groups) - 1, spilled, _format(self.budget_nbytes))
        return candidate

    def minimum_working_set(self, staging_sets: int = 2) -> WorkingSet:
        """What host memory must hold whatever the budget (:func:`working_set`)."""
        layout, placement, itemsize = self.layout, self.placement, self.itemsize
        charged = {"host"} if placement.distinct else {"host", "device"}  # tiers that are host memory here
        grad_bytes = itemsize if placement.grads_lossless else 4
        # a split optimizer's device sub-groups (gradients and states) are host memory only where the device is
        offloaded_numel = layout.trainable_numel - placement.device_numel
        device_numel = placement.device_numel if "device" in charged else 0
        spilled_numel, spill_buffers = self._spilled_gradients(grad_bytes)
        grads = (((offloaded_numel - spilled_numel) * grad_bytes + spill_buffers if placement.grads.tier in charged
                  else 0) + device_numel * grad_bytes)
        threshold = self.zero.param_persistence_threshold
        if placement.compute_shard.tier in charged:
            shards = layout.total_numel * itemsize
        elif placement.compute_shard.tier == "nvme":  # persistent shards rest in host memory all the same
            persistent = layout.persistent_slots(threshold)
            shards = packed_offsets([s.shard_numel for s in layout.slots if s.index in persistent])[1] * itemsize
        else:
            shards = 0
        states = ((state_nbytes(self.state_dtype, offloaded_numel) if placement.master.tier in charged else 0)
                  + state_nbytes(self.state_dtype, device_numel))
        # with one rank and the shards in device memory each shard is its full tensor: nothing is gathered
        aliased = layout.world_size == 1 and placement.compute_shard.tier == "device"
        gathered = 0 if placement.distinct or aliased else gathered_nbytes(
            layout.persistent_padded_numel(threshold), layout.largest_fetch_numel, itemsize)
        return working_set((("gradient slices", grads), ("compute shards", shards), ("optimizer states", states)),
                           staging_sets=staging_sets if placement.master.tier == "nvme" else 0,
                           largest_sub_group_numel=layout.largest_sub_group_numel,
                           largest_shard_numel=layout.largest_shard_numel, state_dtype=self.state_dtype,
                           itemsize=itemsize, staged_grad_itemsize=grad_bytes if spilled_numel else 0,
                           gathered=gathered)

    def _with_reserve_nbytes(self) -> int:
        """The minimum working set and the reserve the planner keeps free beside it (gathered parameters beyond
        the minimum's, streaming, scratch): what must fit before any gradient slice is kept in memory."""
        return self.minimum_working_set().nbytes + self.reserve_nbytes()

    def _spilled_gradients(self, grad_bytes: int) -> tuple[int, int]:
        """Elements of gradient slices on NVMe, and the host bytes of the pool they pass through."""
        first = self.placement.nvme_grads_from
        if first is None:
            return 0, 0
        groups = self.layout.sub_groups[first:]
        largest = max((s.shard_numel for g in groups for s in g.slots), default=0)
        return (self.layout.trainable_numel - groups[0].start,
                spill_pool_nbytes(largest, grad_bytes, accumulates=not self.placement.grads_lossless))

    def reserve_nbytes(self, read_pool_nbytes: int = 0) -> int:
        """Host memory kept free for buffers made later or for a moment (:func:`kept_free_nbytes`): what the
        planner never hands to resting states (gathered parameters where the device is the host, scratch, read
        buffers, the gradient ring, streaming)."""
        ring = 0
        if self.placement.grad_route is GradRoute.HOST_RING:
            ring = RING_SLICES * self.layout.largest_shard_numel * self.itemsize
        scratch = self.layout.largest_sub_group_numel * self.itemsize
        return kept_free_nbytes(self.minimum_working_set(), scratch_nbytes=scratch, read_pool_nbytes=read_pool_nbytes,
                                ring_nbytes=ring)

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
