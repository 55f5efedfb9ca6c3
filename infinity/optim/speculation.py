"""What a speculative update assumes and how it is undone.

An overlapped step (:mod:`infinity.optim.overlapped_step`) updates sub-groups before the global norm is known:
:class:`StepCheck` says what it assumes meanwhile (no clipping, no fp16 overflow) and whether it speculates at
all; :class:`UpdateAt` pins an update to its step and learning rate, since it may run after the next step has
begun; :class:`InMemoryUndo` keeps the states in memory undoable (the states on NVMe are undone by their keys'
other side, :mod:`infinity.optim.on_nvme`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch

from infinity.placement.layout import SubGroup
from infinity.placement.placement import fits_free_device_memory
from infinity.placement.tiers import Tiers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepCheck:
    """What an overlapped step assumes while it speculates, and whether it does.

    ``grad_coef`` is the gradient coefficient when nothing clips or overflows (1 / loss scale with fp16,
    else 1); ``max_norm`` the clipping threshold on the unscaled norm (0: no clipping); ``speculate``
    False defers every update until the norm is known."""

    grad_coef: float = 1.0
    max_norm: float = 0.0
    speculate: bool = True

    @property
    def needs_norm(self) -> bool:
        """Some outcome other than commit is possible (clipping, or an fp16 overflow)."""
        return self.max_norm > 0 or self.grad_coef != 1.0

    def surely_rejected(self, sq_norm_so_far: float) -> bool:
        """The squared norm of part of the gradients already decides that the step clips or overflows."""
        if not math.isfinite(sq_norm_so_far):
            return True
        return self.max_norm > 0 and math.sqrt(sq_norm_so_far) * self.grad_coef + 1e-6 > self.max_norm


@dataclass(frozen=True)
class UpdateAt:
    """Which step an update belongs to, and its learning rate: fixed for the step's updates, which may run after
    the next step has begun (:mod:`infinity.optim.step_tail`) and the schedule has moved the optimizer's rate on."""

    step: int
    lr: float


class InMemoryUndo:
    """A copy of the optimizer states in memory, laid out as they are: a speculative update of an in-memory
    sub-group copies its states aside first and a rollback copies them back."""

    def __init__(self, states: dict[str, torch.Tensor], tier: str, tiers: Tiers,
                 views: Callable[[SubGroup, "dict[str, torch.Tensor] | None"], dict[str, torch.Tensor]]):
        self._tier = tier
        self._tiers = tiers
        self._views = views  # a sub-group's views of its state tensors (of the copy, given its tensors)
        self._copy = {name: tiers.empty(tier, t.numel(), t.dtype, owner="step undo copy") for name, t in states.items()}

    @classmethod
    def make(cls, states: dict[str, torch.Tensor], tier: str, tiers: Tiers, views, *,
             reserve_nbytes: int = 0) -> "InMemoryUndo | None":
        """The copy, where the tier's budget has room for it beside ``reserve_nbytes`` of the host-memory budget
        kept free for buffers made later (else None: in-memory sub-groups wait for the norm)."""
        nbytes = sum(t.numel() * t.element_size() for t in states.values())
        room = tiers.stats[tier].room_nbytes()
        if room is not None and tiers.charges_host_memory(tier):
            room -= reserve_nbytes
        device = next(iter(states.values())).device
        if (room is not None and room < nbytes) or not fits_free_device_memory(device, nbytes):
            logger.info("overlapped step with clipping/fp16: no room in the %s memory (budget, or a quarter of "
                        "the free GPU memory) to undo in-memory states; their updates wait for the global norm", tier)
            return None
        logger.info("overlapped step with clipping/fp16: %.1f MiB of %s memory keep in-memory states undoable",
                    nbytes / 2**20, tier)
        return cls(states, tier, tiers, views)

    def save(self, group: SubGroup) -> None:
        copy = self._views(group, self._copy)
        for name, values in self._views(group, None).items():
            copy[name].copy_(values)

    def restore(self, group: SubGroup) -> None:
        copy = self._views(group, self._copy)
        for name, values in self._views(group, None).items():
            values.copy_(copy[name])

    def close(self) -> None:
        for tensor in self._copy.values():
            self._tiers.free(self._tier, tensor)
        self._copy.clear()
