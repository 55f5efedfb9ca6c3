"""Where the optimizer's states rest, decided and allocated once when the optimizer is made, and asked of
sub-group by sub-group afterwards (:class:`OptimizerStates`).

Every sub-group's master and Adam moments rest in one of:

* the optimizer's memory (:class:`~infinity.optim.in_memory.MemoryStates`: device memory for an optimizer on
  the device, else host memory);
* device memory, for the first sub-groups of a split optimizer (:attr:`Placement.device_sub_groups
  <infinity.placement.placement.Placement.device_sub_groups>`: ``offload_optimizer.device: auto``, or a
  ``ratio`` below 1), a second ``MemoryStates`` stepped by the device's Adam;
* NVMe (:class:`~infinity.optim.on_nvme.SwappedStates`: the swap keys and the host staging sets the step
  pipelines them through). With the states on NVMe, the offloaded sub-groups that fit the host-memory budget
  rest in host memory instead (those the step reads first, first: :func:`~infinity.optim.on_nvme.kept_in_host`),
  and only the others are swapped; room for all of them is reserved on the disk now, not mid-run.

Reading and writing one sub-group's states whole (checkpoints, state dicts) goes through
:class:`~infinity.optim.state_io.RestingStates` over the same homes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from infinity.config.sections import ZeroConfig
from infinity.grads.reducer import GradReducer
from infinity.optim.in_memory import MemoryStates
from infinity.optim.on_nvme import StagingSet, SwappedStates, kept_in_host
from infinity.optim.state_io import RestingStates
from infinity.params.compute_shards import ComputeShards
from infinity.placement.copies import Copies
from infinity.placement.layout import ShardLayout, SubGroup
from infinity.placement.placement import Placement
from infinity.placement.tiers import Tiers
from infinity.runtime.trace import Timeline

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OptimizerParts:
    """The engine's parts an optimizer works with."""

    layout: ShardLayout
    placement: Placement
    tiers: Tiers
    compute: ComputeShards
    """Where the kernel's new compute shards go."""
    grads: GradReducer
    """Where the gradient slices are read."""
    copies: Copies
    timeline: Timeline | None = None
    rank: int = 0


class OptimizerStates:
    def __init__(self, parts: OptimizerParts, zero: ZeroConfig, *, state_dtype: str, staging_sets: int,
                 reserve_nbytes: int, compute_pinned: bool):
        """Allocate every sub-group's states where they rest. ``zero`` gives the tier (``offload_optimizer``) and
        whether steps overlap backward (the sub-groups kept in host memory are then those backward finishes
        first); ``staging_sets`` host buffer sets pipeline the states on NVMe (their compute buffers pinned with
        ``compute_pinned``), and ``reserve_nbytes`` of the host budget is left to others."""
        layout, placement, tiers = parts.layout, parts.placement, parts.tiers
        offload = zero.offload_optimizer
        self.layout = layout
        self.state_dtype = state_dtype
        tier = placement.master.tier
        # the states in memory (host memory for NVMe's sub-groups kept within the budget)
        self.memory = MemoryStates(tiers, parts.copies, tier="device" if tier == "device" else "host",
                                   state_dtype=state_dtype, on_device=placement.optimizer_on_device)
        self.device: MemoryStates | None = None
        """A split optimizer's device sub-groups' states (None without a split)."""
        offloaded = layout.sub_groups
        if placement.split:
            self.device = MemoryStates(tiers, parts.copies, tier="device", state_dtype=state_dtype, on_device=True)
            self.device.allocate(layout.sub_groups[:placement.device_sub_groups])
            offloaded = layout.sub_groups[placement.device_sub_groups:]
        self.store = None
        self.swapped: SwappedStates | None = None  # the staging sets and swap keys of the states on NVMe
        if tier == "nvme":
            self.store = tiers.swap_store(offload.nvme_path)
            # Two sets pipeline a step; more let the overlapped step read states ahead during forward.
            pipelined = offload.pipeline_read or offload.pipeline_write
            self.swapped = SwappedStates(self.store, tiers, state_dtype,
                                         largest_numel=layout.largest_sub_group_numel,
                                         set_count=max(2, staging_sets) if pipelined else 1,
                                         compute_dtype=parts.compute.dtype,
                                         compute_pinned=compute_pinned,
                                         grad_dtype=parts.grads.slices.dtype if parts.grads.spill else None)
            room = tiers.host_memory.room_nbytes()  # after the staging sets: what the budget has left
            # a sub-group whose gradient slices rest on NVMe is updated from a staging set: its states rest there too
            self._keep_in_host([g for g in offloaded if not placement.grads_on_nvme(g.index)],
                               0 if room is None else room - reserve_nbytes,
                               zero.overlap_step_with_backward, offload.max_in_cpu)
        else:
            self.memory.allocate(offloaded)
        self.resting = RestingStates(state_dtype, tiers, self.memory_of, self.store,
                                     self.swapped.key if self.swapped is not None else None)
        """One sub-group's states read and written whole (checkpoints)."""
        self.swapped_groups = [g for g in layout.sub_groups if not self.in_memory(g)]
        """Sub-groups whose states rest on NVMe (the others are in memory)."""
        if self.swapped is not None:
            self.swapped.reserve_states(self.swapped_groups)  # a disk without room fails now, not mid-run

    def _keep_in_host(self, groups, room_nbytes: int, backward_order: bool, max_in_cpu: int | None) -> None:
        """NVMe as a spill tier: of the offloaded sub-groups ``groups``, those that fit in ``room_nbytes`` keep
        their states in host memory (with no budget, none do: ``device: nvme`` then means NVMe); see
        :func:`~infinity.optim.on_nvme.kept_in_host` for which."""
        kept = kept_in_host(groups, room_nbytes, self.state_dtype, backward_order=backward_order,
                            max_in_cpu=max_in_cpu)
        if not kept:
            return
        self.memory.allocate(kept)
        logger.info("optimizer states: %d of %d offloaded sub-groups (%d of %d elements) rest in host memory within "
                    "its budget; the rest is on NVMe", len(kept), len(groups), sum(g.numel for g in kept),
                    sum(g.numel for g in groups))

    @property
    def staging_sets(self) -> list[StagingSet]:
        """The host buffers swapped sub-groups are updated in (none unless the states are on NVMe)."""
        return self.swapped.sets if self.swapped is not None else []

    def in_memory(self, group: SubGroup) -> bool:
        return self.memory_of(group) is not None

    def memory_of(self, group: SubGroup) -> MemoryStates | None:
        """The states in memory that hold ``group`` (the device's of a split optimizer, or the others'); None
        when it rests on NVMe."""
        if self.device is not None and self.device.holds(group):
            return self.device
        return self.memory if self.memory.holds(group) else None

    def state_tier(self, group: SubGroup) -> str:
        """Where ``group``'s states rest: ``device``, ``host`` or ``nvme``."""
        memory = self.memory_of(group)
        return "nvme" if memory is None else memory.tier

    @property
    def resident_numel(self) -> int:
        """Elements whose states rest in memory (all of them unless the tier is NVMe)."""
        return sum(g.numel for g in self.layout.sub_groups if self.in_memory(g))

    def close(self) -> None:
        if self.swapped is not None:
            self.swapped.close()
        self.memory.close()
        if self.device is not None:
            self.device.close()
