"""A split optimizer in the estimate: the device sub-groups' states and gradient slices moved from the offloaded
tier to the device, and ``optimizer_split`` (sub-groups and bytes on the device, in host memory, on NVMe) added.

The split follows :func:`~infinity.placement.optimizer_split.decide_split`'s rules over the estimate's
sub-groups: the first ``int((1 - ratio) * sub-groups)`` for a ``ratio``; for ``auto`` the longest run of first
sub-groups whose states and gradient slices fit the device budget (a fraction of it is of the device memory free
now after the estimate's device bytes, where a GPU is at hand; else of the host's available memory).
"""

from __future__ import annotations

import torch

from infinity.config.schema import InfinityConfig
from infinity.config.tier_names import OffloadDevice
from infinity.kernels import state_nbytes
from infinity.placement.optimizer_split import resolve_device_budget


def device_sub_group_count(config: InfinityConfig, sub_group_numels: list[int], *, grad_itemsize: int,
                           working_set_nbytes: int, gpu: bool) -> int:
    """How many of the first sub-groups (of ``sub_group_numels`` elements) rest on the device."""
    offload = config.zero.offload_optimizer
    n = len(sub_group_numels)
    if offload.device is not OffloadDevice.AUTO:
        return int((1.0 - offload.ratio) * n)
    device = torch.device("cuda") if gpu and torch.cuda.is_available() else torch.device("cpu")
    budget = resolve_device_budget(config.zero.device_memory_budget, device, working_set_nbytes)
    count = total = 0
    for numel in sub_group_numels:
        total += state_nbytes(offload.state_dtype, numel) + numel * grad_itemsize
        if total > budget:
            break
        count += 1
    return count


def apply_optimizer_split(est: dict, config: InfinityConfig) -> dict:
    """``est`` (an estimate of the offloaded tier for every sub-group) with the split applied, in place."""
    tiers, state_dtype = est["tiers"], config.zero.offload_optimizer.state_dtype
    numels = est["sub_group_numels"]
    train_numel = sum(numels)
    host_grads = tiers["host"]["gradients"]
    grad_itemsize = host_grads // train_numel if train_numel and host_grads else 4
    count = device_sub_group_count(config, numels, grad_itemsize=grad_itemsize, gpu=est["setting"]["gpu"],
                                   working_set_nbytes=sum(tiers["device"].values()))
    device_numel = sum(numels[:count])
    master_bytes = 4 if state_dtype == "fp32" else 2
    moved = {"master": device_numel * master_bytes,
             "moments": state_nbytes(state_dtype, device_numel) - device_numel * master_bytes}
    for kind, nbytes in moved.items():
        for tier in ("nvme", "host"):  # offloaded states not kept in host memory are on NVMe: taken from there first
            taken = min(nbytes, tiers[tier][kind])
            tiers[tier][kind] -= taken
            nbytes -= taken
        tiers["device"][kind] += moved[kind]
    tiers["host"]["gradients"] -= device_numel * grad_itemsize
    tiers["device"]["gradients"] += device_numel * grad_itemsize
    est["totals"] = {t: sum(kinds.values()) for t, kinds in tiers.items()}
    est["accounted"] = dict(est["totals"], device=est["totals"]["device"] - tiers["device"]["activations"])
    est["optimizer_split"] = {
        "device_sub_groups": count, "sub_groups": len(numels), "device_numel": device_numel,
        "nbytes": {tier: tiers[tier]["master"] + tiers[tier]["moments"] for tier in ("device", "host", "nvme")},
    }
    est["setting"]["offload_optimizer"] = config.zero.offload_optimizer.device.value
    est["setting"]["optimizer_ratio"] = config.zero.offload_optimizer.ratio
    return est
