"""The optimizer states that rest in memory: all of them when the optimizer's
tier is the device or host memory, and with NVMe the sub-groups kept within the
host budget. One flat tensor per state tensor of ``kernels.state_layout``
(master, moments, and for int8 moments their block scales), each sub-group at
its offset; scales at their own block offsets, so every sub-group's blocks
start with it.

Reads and writes from the host (initial masters, checkpoints, consolidated
state dicts) cross through :class:`~infinity.placement.copies.Copies` when the states
are in device memory.
"""

from __future__ import annotations

import torch

from infinity import kernels
from infinity.placement.copies import Copies
from infinity.placement.layout import SubGroup
from infinity.placement.tiers import Tiers

SCALE_NAMES = ("exp_avg_scale", "exp_avg_sq_scale")
"""The state tensors (int8 moments) laid out by blocks rather than elements."""


class MemoryStates:
    def __init__(self, tiers: Tiers, copies: Copies, *, tier: str, state_dtype: str, on_device: bool):
        self.tier = tier
        """``device`` or ``host``: where these tensors are counted."""
        self._tiers = tiers
        self._copies = copies
        self._state_dtype = state_dtype
        self._on_device = on_device
        self.tensors: dict[str, torch.Tensor] = {}  # one flat tensor per state_layout tensor
        self._offset: dict[int, int] = {}           # sub-group index -> its start in those flat tensors
        self._block_offset: dict[int, int] = {}     # sub-group index -> its first block in the scale tensors (int8)

    def allocate(self, groups) -> None:
        """One zeroed flat tensor per state tensor for ``groups``, each sub-group at its offset."""
        numel = blocks = 0
        for group in sorted(groups, key=lambda g: g.index):
            self._offset[group.index], self._block_offset[group.index] = numel, blocks
            numel += group.numel
            blocks += kernels.compact.num_blocks(group.numel)
        for spec in kernels.state_layout(self._state_dtype, numel):
            self.tensors[spec.name] = self._tiers.empty(self.tier, blocks if spec.name in SCALE_NAMES else numel,
                                                        spec.dtype, owner="optimizer states", optimizer_share=True)
            self.tensors[spec.name].zero_()

    def holds(self, group: SubGroup) -> bool:
        return group.index in self._offset

    def views(self, group: SubGroup, tensors: "dict[str, torch.Tensor] | None" = None) -> dict[str, torch.Tensor]:
        """Views of a sub-group's state tensors (in ``tensors``, laid out as these: the undo copy)."""
        return {spec.name: self._view(spec.name, group, 0, spec.numel, tensors)
                for spec in kernels.state_layout(self._state_dtype, group.numel)}

    def _view(self, name: str, group: SubGroup, at: int, numel: int,
              tensors: "dict[str, torch.Tensor] | None" = None) -> torch.Tensor:
        start = (self._block_offset if name in SCALE_NAMES else self._offset)[group.index] + at
        return (self.tensors if tensors is None else tensors)[name][start:start + numel]

    def read(self, name: str, group: SubGroup, out_host: torch.Tensor) -> None:
        """Copy the start of one of a sub-group's state tensors into host ``out_host`` (same dtype)."""
        source = self._view(name, group, 0, out_host.numel())
        if self._on_device:
            self._copies.host_waits(self._copies.to_host(source, out_host))  # the caller reads it next
        else:
            out_host.copy_(source)

    def write(self, name: str, group: SubGroup, values_host: torch.Tensor, *, at: int = 0) -> None:
        """Write host values into one of a sub-group's state tensors, ``at`` elements into it (fp32 masters are
        rounded to nearest into a bf16 master)."""
        target = self._view(name, group, at, values_host.numel())
        values_host = values_host.to(target.dtype)
        if self._on_device:
            self._copies.host_waits(self._copies.to_device(values_host, target))  # the caller may reuse values
        else:
            target.copy_(values_host)

    def close(self) -> None:
        for tensor in self.tensors.values():
            self._tiers.free(self.tier, tensor, optimizer_share=True)
        self.tensors.clear()
