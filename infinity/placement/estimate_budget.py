"""The estimate within a host-memory budget, as the engine plans it (:mod:`infinity.placement.host_budget`):
compute shards past the budget go back to NVMe, optimizer sub-groups configured for NVMe come to host memory
while they fit, and a speculative step's undo takes its second extents on NVMe and, where there is room, a copy
of the states in memory. Both move bytes between the tiers of an :func:`~infinity.placement.estimate.estimate`.
"""

from __future__ import annotations

from infinity.placement.host_budget import state_nbytes
from infinity.storage.buffers import round_up

__all__ = ["add_step_undo", "plan_within_budget"]


def plan_within_budget(tiers: dict, budget: int, *, gpu: bool, reserve: int, cbytes: int, sub_groups: list[int],
                       offload_param: str, offload_optimizer: str, optimizer_max_in_cpu: int | None,
                       overlap_step: bool, state_dtype: str = "fp32", keepable: int | None = None) -> None:
    """The engine's plan (``infinity.placement.host_budget``): what exceeds the budget of the parameter cache goes back
    to NVMe, then optimizer sub-groups on NVMe (of the first ``keepable``: those whose gradient slices are in
    memory) come to host memory while they fit, beside the ``reserve`` kept free (gathered parameters, streaming,
    scratch: :func:`~infinity.placement.host_budget.kept_free_nbytes`)."""
    if offload_param == "nvme":
        excess = max(0, _charged_to_host_budget(tiers, gpu=gpu) + reserve - budget)
        back = min(tiers["host"]["compute_shard"], round_up(excess, cbytes))
        tiers["host"]["compute_shard"] -= back
        tiers["nvme"]["compute_shard"] += back
    if offload_optimizer == "nvme" and optimizer_max_in_cpu != 0:
        room = budget - _charged_to_host_budget(tiers, gpu=gpu) - reserve
        kept = kept_nbytes = 0
        candidates = sub_groups[:keepable]
        for numel in (reversed(candidates) if overlap_step else candidates):
            nbytes = state_nbytes(state_dtype, numel)
            fits = kept_nbytes + nbytes <= room
            if fits and (optimizer_max_in_cpu is None or kept + numel <= optimizer_max_in_cpu):
                kept += numel
                kept_nbytes += nbytes
        master = kept * (4 if state_dtype == "fp32" else 2)
        for kind, nbytes in (("master", master), ("moments", kept_nbytes - master)):
            tiers["nvme"][kind] -= nbytes
            tiers["host"][kind] += nbytes


def add_step_undo(tiers: dict, budget: int | None, *, gpu: bool, reserve: int, optim_memory: str) -> None:
    """What undoing a speculative step needs (``infinity.optim.overlapped_step``): the other side of every swapped
    sub-group's state keys, and one copy of the states in memory when the budget has room for it beside the
    ``reserve`` kept free."""
    tiers["nvme"]["step_undo"] += tiers["nvme"]["master"] + tiers["nvme"]["moments"]
    in_memory = tiers[optim_memory]["master"] + tiers[optim_memory]["moments"]
    charged_to_host = optim_memory == "host" or not gpu
    if (budget is not None and charged_to_host
            and _charged_to_host_budget(tiers, gpu=gpu) + reserve + in_memory > budget):
        return  # no room: those sub-groups wait for the norm instead
    tiers[optim_memory]["step_undo"] += in_memory


def _charged_to_host_budget(tiers: dict, *, gpu: bool) -> int:
    """What the host-memory budget is charged when the planner measures its room: host memory, and device memory
    where the device is the host (but the gathered parameters, made later: the reserve keeps room for them)."""
    device = 0 if gpu else sum(n for kind, n in tiers["device"].items()
                               if kind not in ("activations", "gathered_params"))
    return sum(tiers["host"].values()) + device
