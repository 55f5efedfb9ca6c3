"""Where every kind of state rests and where every computation runs, decided
once at ``initialize``.

The rest of the engine asks this object instead of testing device types:
which tier and which memory a state lives in, whether its host buffers are
pinned, where the optimizer runs, and which route the gradient slices take
from the backward hook to the optimizer.

Two memories exist: the compute device's and the host's. On a GPU they are
distinct and every crossing goes through :mod:`infinity.placement.copies`. On a machine
without one the device *is* the host, so nothing crosses — unless
``INFINITY_DISTINCT_DEVICE=1`` asks for the test mode, in which device memory
is a distinct set of host buffers and every crossing a GPU run would make is
made (on a copy worker, asynchronously) and counted. That mode exists so the
GPU path's placement, copies and gradient routes run in CI.
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass

import torch

from infinity.config.schema import InfinityConfig
from infinity.config.tier_names import Tier
from infinity.placement.optimizer_split import OptimizerSplit
from infinity.runtime.host_cores import HostCores, plan_host_cores

logger = logging.getLogger(__name__)

DISTINCT_DEVICE_ENV = "INFINITY_DISTINCT_DEVICE"
"""``1``: keep device memory apart from host memory on a machine without a GPU (the test mode)."""


class Memory(str, enum.Enum):
    """The two memories a tensor can live in (an NVMe state is used from host memory): the tiers that are memory."""

    DEVICE = Tier.DEVICE.value
    HOST = Tier.HOST.value


class GradRoute(enum.Enum):
    """How a gradient slice travels from the backward hook to the optimizer."""

    IN_PLACE = "in place"
    """The optimizer's buffer is in the memory the slice is reduced in: reduce (and accumulate) straight into it."""
    DEVICE_THEN_HOST = "accumulate on the device, copy down at the boundary"
    """Accumulate in an fp32 device buffer over micro-batches; each slice crosses to the host once per step."""
    DIRECT_TO_HOST = "copy down as reduced"
    """No accumulation (one micro-batch a step): each reduced slice crosses to the host as soon as it exists."""
    HOST_RING = "copy down each micro-batch, add on the host off the hook"
    """The fp32 accumulator does not fit the device: slices cross every micro-batch through a pinned ring and a
    worker adds them into the host accumulator, so the backward hook never computes on the host."""


RING_SLICES = 4
"""Slices of the largest shard the ``HOST_RING`` route's pinned ring holds: backward stalls only when the adder
is this far behind."""


@dataclass(frozen=True, slots=True)
class StatePlace:
    """One kind of state: the tier it rests in, the memory it is used from, and whether that memory is pinned."""

    tier: Tier
    """``device``, ``host`` or ``nvme``."""
    memory: Memory
    """Where its bytes are read and written: an NVMe state is staged through host memory."""
    pinned: bool
    """Its host buffers are page-locked, so copies to and from the device are asynchronous."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Every state's place and every computation's, for one engine."""

    device: torch.device
    """The compute device (forward, backward, collectives)."""
    distinct: bool
    """Device memory is not host memory: a GPU, or the test mode."""
    compute_shard: StatePlace
    master: StatePlace
    moments: StatePlace
    grads: StatePlace
    """The gradient slices the optimizer reads."""
    optimizer_memory: Memory
    """Where the optimizer runs: ``device`` (torch's fused Adam on a GPU) or ``host`` (the fused CPU kernel)."""
    grad_route: GradRoute
    grads_lossless: bool
    """Gradient slices keep the compute precision: no accumulation, no fp16 unscaling in place, and an
    optimizer that reads low-precision gradients (the CPU kernel); else they are fp32."""
    host_cores: HostCores
    """The fused CPU Adam's threads and the cores the engine's updating threads bind to
    (:mod:`infinity.runtime.host_cores`)."""
    device_sub_groups: int = 0
    """A split optimizer: its first sub-groups, whose states rest in device memory and are stepped there, their
    gradient slices reduced in place on the device (0: no split; ``master``, ``moments``, ``grads`` and
    ``grad_route`` then say where the others rest and how their gradients travel)."""
    device_numel: int = 0
    """A split optimizer: elements of its device sub-groups, where the offloaded ones begin in the trainable
    flat space (0: no split)."""
    nvme_grads_from: int | None = None
    """The first sub-group whose gradient slices rest on NVMe between backward and the step (they and all after it;
    None: every slice is in memory). Set by the host-memory plan where the budget cannot hold the slices
    (:meth:`~infinity.placement.host_budget.HostMemoryPlan.settle`); only sub-groups whose states are on NVMe."""

    @classmethod
    def decide(cls, config: InfinityConfig, device: torch.device, *, distinct: bool,
               grad_accumulator_fits_device: bool = True, split: OptimizerSplit | None = None) -> "Placement":
        """``split``: which sub-groups rest on the device (:func:`~infinity.placement.optimizer_split.decide_split`);
        needed for ``offload_optimizer.device: auto`` and a ``ratio`` below 1, else taken from the device."""
        zero = config.zero
        param_tier = zero.offload_param.device.tier
        offload = zero.offload_optimizer
        if split is None and offload.splits:
            raise ValueError(f"offload_optimizer.device {offload.device.value!r} with ratio {offload.ratio}: "
                             f"the placement needs the split per sub-group (decide_split)")
        optimizer_tier = offload.offloaded_tier
        if split is not None and split.sub_groups and split.device_sub_groups == split.sub_groups:
            optimizer_tier = Tier.DEVICE  # every sub-group fits the device: as offload_optimizer.device none
        partial = split is not None and split.partial
        pin_param = _pin_decision("zero_optimization.offload_param.pin_memory", zero.offload_param.pin_memory,
                                  device, distinct)
        pin_optimizer = _pin_decision("zero_optimization.offload_optimizer.pin_memory",
                                      zero.offload_optimizer.pin_memory, device, distinct)

        def place(tier: Tier, pinned: bool) -> StatePlace:
            if not distinct:
                return StatePlace(tier, Memory.HOST, False)  # the device is the host: one memory
            if tier == Tier.DEVICE:
                return StatePlace(tier, Memory.DEVICE, False)
            return StatePlace(tier, Memory.HOST, pinned)

        optimizer_place = place(optimizer_tier, False)  # master and moments never cross: not pinned
        # gradient slices rest in memory next to the optimizer: host memory when its states are on NVMe
        grads = place(Tier.DEVICE if optimizer_tier == Tier.DEVICE else Tier.HOST, pin_optimizer)
        if not distinct or grads.memory is Memory.DEVICE:
            route = GradRoute.IN_PLACE
        elif config.gradient_accumulation_steps == 1:
            route = GradRoute.DIRECT_TO_HOST
        elif _accumulate_on_device(zero.offload_optimizer.grad_accumulation, grad_accumulator_fits_device):
            route = GradRoute.DEVICE_THEN_HOST
        else:
            route = GradRoute.HOST_RING
        # torch's fused Adam on a GPU takes gradients in the master's precision
        gpu_optimizer = optimizer_place.memory is Memory.DEVICE and device.type == "cuda"
        lossless = config.gradient_accumulation_steps == 1 and config.precision != "fp16" and not gpu_optimizer
        return cls(device=device, distinct=distinct, compute_shard=place(param_tier, pin_param),
                   master=optimizer_place, moments=optimizer_place, grads=grads,
                   optimizer_memory=optimizer_place.memory, grad_route=route, grads_lossless=lossless,
                   host_cores=plan_host_cores(device, offload.host_threads),
                   device_sub_groups=split.device_sub_groups if partial else 0,
                   device_numel=split.device_numel if partial else 0)

    @property
    def optimizer_on_device(self) -> bool:
        """The optimizer's states are in device memory, so it runs there (no gradient crosses)."""
        return self.optimizer_memory is Memory.DEVICE

    @property
    def compute_shard_in_optimizer_memory(self) -> bool:
        """The optimizer can write new compute shards in place (no copy across memories)."""
        return self.compute_shard.tier != Tier.NVME and self.compute_shard.memory is self.optimizer_memory

    @property
    def split(self) -> bool:
        """Some sub-groups rest and are stepped on the device, the others are offloaded."""
        return self.device_sub_groups > 0

    def stepped_on_device(self, group_index: int) -> bool:
        """Sub-group ``group_index``'s states rest in device memory and the device optimizer steps it."""
        return self.optimizer_on_device or group_index < self.device_sub_groups

    def grads_on_nvme(self, group_index: int) -> bool:
        """Sub-group ``group_index``'s gradient slices are written to NVMe as backward makes them, and read back by
        its update (:mod:`infinity.grads.spill`)."""
        return self.nvme_grads_from is not None and group_index >= self.nvme_grads_from

    def compute_shard_in_memory_of(self, group_index: int) -> bool:
        """The optimizer can write sub-group ``group_index``'s new compute shards in place."""
        memory = Memory.DEVICE if self.stepped_on_device(group_index) and self.distinct else self.optimizer_memory
        return self.compute_shard.tier != Tier.NVME and self.compute_shard.memory is memory

    def describe(self) -> str:
        """One line for the log and the train start line."""
        def state(p: StatePlace) -> str:
            pinned = ", pinned" if p.pinned else ""
            return f"{p.tier}{pinned}"
        kernel = f"fused CPU kernel, {self.host_cores.describe()}"
        where = "device" if self.optimizer_on_device else f"host ({kernel})"
        spilled = ("" if self.nvme_grads_from is None else
                   f"; gradient slices of sub-groups {self.nvme_grads_from} and after on NVMe between backward and the step")
        mode = "" if self.device.type != "cpu" or not self.distinct else f" [{DISTINCT_DEVICE_ENV}=1]"
        if self.split:
            return (f"placement on {self.device}{mode}: compute shards {state(self.compute_shard)}; optimizer split: "
                    f"sub-groups 0-{self.device_sub_groups - 1} ({self.device_numel} elements) on the device, "
                    f"stepped there, gradients in place; the rest: master+moments {state(self.master)}, gradients "
                    f"{state(self.grads)} ({self.grad_route.value}), stepped on the host ({kernel}){spilled}")
        return (f"placement on {self.device}{mode}: compute shards {state(self.compute_shard)}; "
                f"master+moments {state(self.master)}; gradients {state(self.grads)} ({self.grad_route.value}); "
                f"optimizer runs on the {where}{spilled}")


def compute_device(setting: str, comm) -> torch.device:
    """Where forward and backward run: the config's ``device``; ``auto``: the current GPU when there is one
    and the collectives (``comm``: world size and backend) can use it."""
    if setting != "auto":
        device = torch.device(setting)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"config key device is {setting!r} but CUDA is not available here")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        return device
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if comm.world_size > 1 and comm.backend == "gloo":
        logger.info("%d ranks over gloo: computing on the CPU (gloo's all-gather and reduce-scatter take CPU "
                    "tensors); initialize the process group with NCCL to compute on the GPU", comm.world_size)
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def device_memory_is_distinct(device: torch.device) -> bool:
    """A GPU has memory of its own; the CPU's is the host's unless the test mode asks to keep them apart."""
    return device.type == "cuda" or distinct_device_requested()


def distinct_device_requested() -> bool:
    """The test mode's switch, read once per engine."""
    value = os.environ.get(DISTINCT_DEVICE_ENV, "0").strip().lower()
    if value not in ("0", "1", "", "false", "true"):
        raise ValueError(f"{DISTINCT_DEVICE_ENV} must be 0 or 1, got {value!r}")
    return value in ("1", "true")


def grad_accumulator_fits_device(device: torch.device, trainable_numel: int) -> bool:
    """An fp32 gradient accumulator fits when it takes at most a quarter of the device memory free now."""
    return fits_free_device_memory(device, trainable_numel * 4)


def fits_free_device_memory(device: torch.device, nbytes: int) -> bool:
    """Whether an optional device buffer of ``nbytes`` takes at most a quarter of the GPU memory free now (the
    rest is for gathered parameters and activations). Without a GPU there is no device budget: True."""
    if device.type != "cuda":
        return True
    free_nbytes, _ = torch.cuda.mem_get_info(device)
    return nbytes <= free_nbytes // 4


def _pin_decision(key: str, requested: bool | None, device: torch.device, distinct: bool) -> bool:
    """``pin_memory``: None pins where a GPU makes it useful; True or False is honoured where there is one."""
    if device.type == "cuda":
        if requested is False:
            logger.warning("%s is false: host buffers stay pageable, so their copies to and from the GPU "
                           "are synchronous", key)
        return requested is not False
    if requested:
        # Pinning is a property of host memory seen from a GPU; there is none here. Said once, loudly.
        logger.warning("%s is true but there is no GPU: host memory stays pageable (nothing to pin for)", key)
    return False


def _accumulate_on_device(setting: str, fits: bool) -> bool:
    if setting == "device_if_fits":
        return fits
    return setting == "device"
