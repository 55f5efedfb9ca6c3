"""Gradient slices on NVMe in the estimate: where the host-memory budget cannot hold the minimum working set with
every gradient slice in it, the slices of as few of the last sub-groups as make it fit rest on NVMe between
backward and the step, as :meth:`HostMemoryPlan.settle <infinity.placement.host_budget.HostMemoryPlan.settle>`
decides for the engine: their host bytes become a few buffers, each staging set holds a sub-group of them read
back, and NVMe holds one extent a slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from infinity.placement.host_budget import spill_pool_nbytes
from infinity.placement.layout import ALIGN_NUMEL, cut_runs
from infinity.storage.buffers import round_up


@dataclass(frozen=True, slots=True)
class GradSpillPlan:
    """Which sub-groups' gradient slices rest on NVMe, and what that moves between the tiers."""

    first_group: int | None
    """The first sub-group whose slices rest on NVMe (None: none do)."""
    host_nbytes: int = 0
    """Host bytes the slices no longer take, less the spill's buffers."""
    nvme_nbytes: int = 0
    """The slots' extents on NVMe."""
    staging_nbytes: int = 0
    """A sub-group of slices in each staging set, read back by the step."""


def sub_group_shards(shards: Sequence[int], sub_group_size: int,
                     decays: Sequence[float | None] | None = None) -> list[list[int]]:
    """The shards (element counts) of each sub-group, cut as the layout cuts them (:func:`cut_runs`)."""
    return [list(shards[run.start:run.stop]) for run in cut_runs(shards, sub_group_size, decays)]


def sub_group_numel(shards: Sequence[int]) -> int:
    """Elements of a sub-group of ``shards`` in the flat space: each shard starts aligned."""
    return sum(round_up(n, ALIGN_NUMEL) for n in shards)


def plan_grad_spill(minimum_nbytes: int, budget_nbytes: int, *, groups: list[list[int]], grad_itemsize: int,
                    accumulates: bool, staging_sets: int) -> GradSpillPlan:
    """``minimum_nbytes``: the engine's minimum working set with every slice in host memory (two staging sets) and
    the reserve its planner keeps free beside it; ``groups``: each sub-group's shards. The fewest last sub-groups
    whose slices on NVMe bring it within ``budget_nbytes`` (all of them when none do: the engine then refuses the
    budget, naming the smallest)."""
    if minimum_nbytes <= budget_nbytes or not groups:
        return GradSpillPlan(None)
    sizes = [sub_group_numel(g) for g in groups]
    largest_group = max(sizes)
    first = len(groups) - 1
    for first in range(len(groups) - 1, -1, -1):
        spilled = sum(sizes[first:])
        largest = max(n for g in groups[first:] for n in g)
        smaller = (minimum_nbytes - spilled * grad_itemsize
                   + spill_pool_nbytes(largest, grad_itemsize, accumulates=accumulates)
                   + 2 * largest_group * grad_itemsize)
        if smaller <= budget_nbytes:
            break
    spilled = sum(sizes[first:])
    largest = max(n for g in groups[first:] for n in g)
    return GradSpillPlan(
        first,
        host_nbytes=spilled * grad_itemsize - spill_pool_nbytes(largest, grad_itemsize, accumulates=accumulates),
        nvme_nbytes=sum(round_up(n * grad_itemsize) for g in groups[first:] for n in g),
        staging_nbytes=staging_sets * largest_group * grad_itemsize)

