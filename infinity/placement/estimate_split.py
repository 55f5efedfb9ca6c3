"""A split optimizer in the estimate: the device sub-groups' states and gradient slices moved from the offloaded
tier to the device, and ``optimizer_split`` (sub-groups and bytes on the device, in host memory, on NVMe) added.

Which sub-groups may go follows :func:`~infinity.placement.optimizer_split.decide_split`'s rules over the
estimate's sub-groups: the first ``int((1 - ratio) * sub-groups)`` for a ``ratio``; for ``auto`` at most the
longest run of first sub-groups whose states and gradient slices fit the device budget (a fraction of it is of
the device memory free now after the estimate's device bytes, where a GPU is at hand; else of the host's
available memory). Among those, :mod:`infinity.placement.split_choice` picks ``auto``'s count by the step-time
model; this module only counts what fits and moves the bytes.
"""

from __future__ import annotations

import torch

from infinity.config.schema import InfinityConfig
from infinity.config.tier_names import OffloadDevice
from infinity.kernels import state_nbytes
from infinity.placement.optimizer_split import resolve_device_budget


def device_budget_nbytes(config: InfinityConfig, *, working_set_nbytes: int, gpu: bool) -> int:
    """The device budget resolved as the engine resolves it (a fraction of the free memory after
    ``working_set_nbytes``; bytes as given)."""
    device = torch.device("cuda") if gpu and torch.cuda.is_available() else torch.device("cpu")
    return resolve_device_budget(config.zero.device_memory_budget, device, working_set_nbytes)


def device_sub_group_count(config: InfinityConfig, sub_group_numels: list[int], *, grad_itemsize: int,
                           working_set_nbytes: int, gpu: bool) -> int:
    """How many of the first sub-groups (of ``sub_group_numels`` elements) may rest on the device: the ratio's,
    or for ``auto`` the longest run within the device budget."""
    offload = config.zero.offload_optimizer
    n = len(sub_group_numels)
    if offload.device is not OffloadDevice.AUTO:
        return int((1.0 - offload.ratio) * n)
    budget = device_budget_nbytes(config, working_set_nbytes=working_set_nbytes, gpu=gpu)
    count = total = 0
    for numel in sub_group_numels:
        total += state_nbytes(offload.state_dtype, numel) + numel * grad_itemsize
        if total > budget:
            break
        count += 1
    return count


def grad_itemsize_of(est: dict) -> int:
    """Bytes of an offloaded gradient slice's element in ``est`` (an estimate with every sub-group offloaded)."""
    train_numel = sum(est["sub_group_numels"])
    host_grads = est["tiers"]["host"]["gradients"]
    return host_grads // train_numel if train_numel and host_grads else 4


def move_to_device(est: dict, config: InfinityConfig, count: int, device_numel: int) -> dict:
    """``est`` (every sub-group offloaded) with its first ``count`` sub-groups (``device_numel`` elements) on the
    device, in place: their states and gradient slices moved, ``totals``, ``accounted`` and ``optimizer_split``
    (without the choice's figures) set."""
    tiers, state_dtype = est["tiers"], config.zero.offload_optimizer.state_dtype
    grad_itemsize = grad_itemsize_of(est)
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
        "device_sub_groups": count, "sub_groups": len(est["sub_group_numels"]), "device_numel": device_numel,
        "nbytes": {tier: tiers[tier]["master"] + tiers[tier]["moments"] for tier in ("device", "host", "nvme")},
    }
    est["setting"]["offload_optimizer"] = config.zero.offload_optimizer.device.value
    est["setting"]["optimizer_ratio"] = config.zero.offload_optimizer.ratio
    return est
