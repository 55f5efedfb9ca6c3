"""Which optimizer sub-groups rest on the device and which are offloaded: decided once at ``initialize``, from
the layout's sub-groups and the config, before any buffer exists.

* ``offload_optimizer.device: none``: every sub-group on the device; ``cpu``/``nvme`` with ``ratio`` 1: none.
* ``ratio`` below 1 (DeepSpeed's key, the fraction offloaded): the first ``int((1 - ratio) * sub-groups)``
  sub-groups stay on the device, as DeepSpeed splits them; an explicit ``device_memory_budget`` must hold them.
* ``auto`` (ours): at most the longest run of first sub-groups whose states and gradient slices fit the
  device-memory budget (``zero_optimization.device_memory_budget``); among those counts the step-time model
  chooses (:mod:`infinity.placement.split_choice`, handed in as ``choose``), else the longest run.

The budget is enforced, not only chosen by: :attr:`OptimizerSplit.budget_nbytes` is the bytes the device tier's
optimizer share (:class:`~infinity.placement.tiers.Tiers`: states and gradient slices resting on the device) may
hold, and an allocation past it is refused naming the key.

Why the *first* sub-groups: they hold the first layers' parameters, whose gradients are final last in backward.
An offloaded sub-group's gradients cross down and the CPU kernel steps it while backward goes on, hidden behind
the layers still to run; the last gradients to be final have nothing left to hide that work behind, so their
step is the one the device does best. (And a run of first sub-groups is one contiguous run of the trainable
flat space, so the gradient slices split into one device range and one host range.)

Device memory is accounted apart from host memory on every machine (:mod:`infinity.placement.tiers`), so a budget
in bytes means the same thing on a GPU, in the distinct-device test mode and where the device is the host.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from infinity.config.schema import InfinityConfig
from infinity.config.sections import DEFAULT_DEVICE_FRACTION
from infinity.config.tier_names import OffloadDevice
from infinity.kernels import state_nbytes
from infinity.placement.layout import ShardLayout
from infinity.storage.stats import format_nbytes

logger = logging.getLogger(__name__)

BUDGET_KEY = "zero_optimization.device_memory_budget"


@dataclass(frozen=True, slots=True)
class OptimizerSplit:
    """The first ``device_sub_groups`` sub-groups rest on the device; the others are offloaded."""

    device_sub_groups: int
    """Sub-groups (the first ones) whose states rest in device memory, stepped by the device optimizer."""
    sub_groups: int
    """Sub-groups in all."""
    device_numel: int
    """Elements of the device's sub-groups: where the offloaded ones begin in the trainable flat space."""
    trainable_numel: int
    why: str = ""
    """How the split was chosen, for the log."""
    budget_nbytes: int | None = None
    """Bytes the optimizer's states and gradient slices on the device may take (``device_memory_budget``
    resolved; enforced by the tiers' accounting); None: no budget (no split, or a ratio without one)."""
    choice: dict | None = None
    """How a split's count was chosen: ``chosen_by`` (``offload_optimizer.ratio``, ``device_memory_budget``: the
    longest run that fits, or ``step-time model``) and ``fitting_sub_groups`` (``auto``), plus the step-time
    model's predictions when it chose (``SplitChoice.as_dict``); None without a split config."""

    @property
    def partial(self) -> bool:
        """Some sub-groups on the device and some offloaded."""
        return 0 < self.device_sub_groups < self.sub_groups

    @property
    def offloaded_numel(self) -> int:
        return self.trainable_numel - self.device_numel


def decide_split(config: InfinityConfig, layout: ShardLayout, device: torch.device, *,
                 grad_itemsize: int, working_set_nbytes: int = 0,
                 choose: Callable[[list[int]], object | None] | None = None) -> OptimizerSplit:
    """The split for ``config`` over ``layout``'s sub-groups. ``grad_itemsize``: bytes of a device gradient slice
    element; ``working_set_nbytes``: device memory the model needs whatever the split (compute shards on the
    device, gathered parameters, scratch), taken off the free memory a fractional budget is a share of.
    ``choose`` (``auto``): given the elements of the first 0, 1, ... k sub-groups (k the longest run that fits),
    the step-time model's choice (``device_sub_groups``, ``as_dict()``, ``describe()``), or None to keep k."""
    offload = config.zero.offload_optimizer
    groups = layout.sub_groups
    n = len(groups)
    if offload.device is OffloadDevice.NONE:
        return _split(layout, n, "offload_optimizer.device none")
    if not offload.splits:
        return _split(layout, 0, f"offload_optimizer.device {offload.device.value}")
    per_group = [state_nbytes(offload.state_dtype, g.numel) + g.numel * grad_itemsize for g in groups]
    if device.type == "cuda" and n:
        # every sub-group on the device is an optimizer on the device, stepped by torch's fused AdamW on fp32
        # gradients: the last sub-group to join brings the others' slices to 4 bytes an element
        per_group[-1] += layout.trainable_numel * max(0, 4 - grad_itemsize)
    budget = config.zero.device_memory_budget
    if offload.device is not OffloadDevice.AUTO:
        # DeepSpeed's rule: sub-group i is offloaded when i >= int((1 - ratio) * sub-groups)
        count = int((1.0 - offload.ratio) * n)
        need = sum(per_group[:count])
        budget_nbytes = None if budget is None else resolve_device_budget(budget, device, working_set_nbytes)
        if budget_nbytes is not None and need > budget_nbytes:
            raise ValueError(
                f"zero_optimization.offload_optimizer.ratio {offload.ratio} keeps {count} of {n} sub-groups on "
                f"the device ({format_nbytes(need)} of states and gradient slices), more than {BUDGET_KEY} "
                f"({format_nbytes(budget_nbytes)}): raise the ratio or the budget, or use device 'auto'")
        return _split(layout, count, f"offload_optimizer.ratio {offload.ratio}", budget_nbytes,
                      {"chosen_by": "offload_optimizer.ratio"})
    budget_nbytes = resolve_device_budget(budget, device, working_set_nbytes)
    count, total = 0, 0
    for nbytes in per_group:  # a run of first sub-groups: stop at the first that does not fit
        if total + nbytes > budget_nbytes:
            break
        total += nbytes
        count += 1
    within = f"offload_optimizer.device auto within {BUDGET_KEY} {format_nbytes(budget_nbytes)}"
    choice = choose(_device_numels(layout, count)) if choose is not None and count else None
    if choice is None:
        return _split(layout, count, within + f": the longest run of first sub-groups that fits ({count})",
                      budget_nbytes, {"chosen_by": BUDGET_KEY, "fitting_sub_groups": count})
    return _split(layout, choice.device_sub_groups, f"{within}: {choice.describe()}", budget_nbytes,
                  choice.as_dict())


def _device_numels(layout: ShardLayout, fitting: int) -> list[int]:
    """Elements of the first 0, 1, ... ``fitting`` sub-groups."""
    groups = layout.sub_groups
    return [0 if k == 0 else groups[k].start if k < len(groups) else layout.trainable_numel
            for k in range(fitting + 1)]


def device_working_set_nbytes(config: InfinityConfig, layout: ShardLayout, itemsize: int) -> int:
    """Device memory the model needs whatever the split: compute shards resting on the device, two of its
    largest gathered parameters, and one sub-group of scratch for new compute shards."""
    shards = layout.total_numel * itemsize if config.zero.offload_param.device is OffloadDevice.NONE else 0
    gathered = 2 * layout.largest_shard_numel * layout.world_size * itemsize
    return shards + gathered + layout.largest_sub_group_numel * itemsize


def resolve_device_budget(setting: int | float | None, device: torch.device, working_set_nbytes: int = 0) -> int:
    """Bytes of device memory a split optimizer may take: bytes as given, or a fraction (None:
    :data:`DEFAULT_DEVICE_FRACTION`) of the device memory free now after ``working_set_nbytes`` (without a GPU,
    the device's memory is the host's: the memory available now)."""
    if isinstance(setting, int):
        return setting
    fraction = DEFAULT_DEVICE_FRACTION if setting is None else setting
    if device.type == "cuda":
        free_nbytes, _ = torch.cuda.mem_get_info(device)
    else:
        import psutil
        free_nbytes = psutil.virtual_memory().available
    return int(max(0, free_nbytes - working_set_nbytes) * fraction)


def _split(layout: ShardLayout, count: int, why: str, budget_nbytes: int | None = None,
           choice: dict | None = None) -> OptimizerSplit:
    groups = layout.sub_groups
    device_numel = groups[count].start if count < len(groups) else layout.trainable_numel
    split = OptimizerSplit(count, len(groups), device_numel if count else 0, layout.trainable_numel, why,
                           budget_nbytes, choice)
    if split.partial:
        logger.info("optimizer split (%s): sub-groups 0-%d (%d elements) rest on the device, %d-%d (%d elements) "
                    "are offloaded", why, count - 1, split.device_numel, count, len(groups) - 1,
                    split.offloaded_numel)
    return split
