"""Where each parameter's shard sits in this rank's flat spaces.

Every managed parameter is flattened and padded to a multiple of the world
size; this rank owns ``shard_numel`` elements of it. The rank's shards are laid
end to end in one flat space (trainable parameters first, then frozen ones),
each starting at a multiple of ``ALIGN_NUMEL`` elements so that a shard's view
of an aligned buffer is itself aligned for direct I/O. The optimizer's flat
spaces (master, moments, gradients) use the same offsets over the trainable
prefix, so one offset names a parameter's place in all of them.

Sub-groups cut the trainable prefix into runs of whole parameters of at most
``sub_group_size`` elements (a larger parameter is a sub-group alone); the
optimizer updates and swaps one sub-group at a time. Where parameters have
weight decays of their own (param groups), a sub-group also ends where the
decay changes, so each sub-group has one; with one decay for all the cuts are
those of the size alone. The trainable parameters of one decay are laid out
together (each decay's in model order, the decay with the fewest elements
first: :func:`decay_order`): otherwise the usual groups (no decay on biases and
norms) would cut a sub-group at every bias, into hundreds of small ones the
optimizer steps and swaps one by one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

ALIGN_NUMEL = 2048
"""Shard offsets are multiples of this many elements: 4096 bytes at 2 bytes an element."""


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """One parameter's place: its name, full shape, and this rank's shard."""

    index: int
    name: str
    shape: torch.Size
    numel: int
    shard_numel: int
    offset: int
    """Start of this rank's shard in the flat spaces (elements)."""
    trainable: bool
    world_size: int
    weight_decay: float | None = None
    """This parameter's own weight decay (a param group's); None: the optimizer's one ``weight_decay``."""

    @property
    def padded_numel(self) -> int:
        """The flat parameter padded to a multiple of the world size."""
        return self.shard_numel * self.world_size

    @property
    def end(self) -> int:
        return self.offset + self.shard_numel


@dataclass(frozen=True, slots=True)
class SubGroup:
    """A run of whole trainable shards the optimizer updates together."""

    index: int
    start: int
    end: int
    slots: tuple[ParamSlot, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def weight_decay(self) -> float | None:
        """The weight decay of every parameter in it (None: the optimizer's one ``weight_decay``)."""
        return self.slots[0].weight_decay


class ShardLayout:
    """This rank's shards of all managed parameters, in one flat space."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], *, world_size: int, sub_group_size: int,
                 weight_decay: Mapping[str, float] | None = None):
        """``weight_decay``: each trainable parameter's own decay by name (param groups); None: the optimizer's one
        ``weight_decay`` for all."""
        self.world_size = world_size
        decay_of = weight_decay or {}
        trainable = [np for np in named_params if np[1].requires_grad]
        order = decay_order([decay_of.get(name) for name, _ in trainable], [p.numel() for _, p in trainable])
        ordered = [trainable[i] for i in order] + \
            [np for np in named_params if not np[1].requires_grad]
        slots, offset = [], 0
        for index, (name, param) in enumerate(ordered):
            numel = param.numel()
            shard_numel = math.ceil(numel / world_size) if numel else 0
            slots.append(ParamSlot(index, name, param.shape, numel, shard_numel, offset, param.requires_grad, world_size,
                                   decay_of.get(name) if param.requires_grad else None))
            offset += _round_up(shard_numel, ALIGN_NUMEL)
        self.slots: tuple[ParamSlot, ...] = tuple(slots)
        self.total_numel = offset
        trainable = [s for s in slots if s.trainable]
        self.trainable_numel = _round_up(trainable[-1].end, ALIGN_NUMEL) if trainable else 0
        self.sub_groups = _cut_sub_groups(trainable, sub_group_size)
        self.group_of_slot: dict[int, SubGroup] = {slot.index: g for g in self.sub_groups for slot in g.slots}
        """Slot index -> its sub-group (trainable slots only: a frozen parameter has no optimizer state)."""

    @property
    def largest_shard_numel(self) -> int:
        return max((s.shard_numel for s in self.slots), default=0)

    def persistent_slots(self, param_persistence_threshold: int) -> frozenset[int]:
        """The slot indices of persistent parameters (at most ``param_persistence_threshold`` elements): their
        full tensors stay in device memory from one use to the next."""
        return frozenset(slot.index for slot in self.slots if slot.numel <= param_persistence_threshold)

    def persistent_padded_numel(self, param_persistence_threshold: int) -> int:
        """Elements of the persistent parameters' full tensors (padded): what stays gathered from their first use."""
        persistent = self.persistent_slots(param_persistence_threshold)
        return sum(slot.padded_numel for slot in self.slots if slot.index in persistent)

    @property
    def largest_fetch_numel(self) -> int:
        """Elements (padded) of the most full parameters one module's forward holds gathered on demand: a module's
        own parameters are fetched together (``infinity.params.hooks``) and held while its children run, so a
        module counts its own and its ancestors'. Modules are told by the parameters' names."""
        own: dict[str, int] = {}
        for slot in self.slots:
            module = slot.name.rpartition(".")[0]
            own[module] = own.get(module, 0) + slot.padded_numel
        largest = 0
        for module in own:
            parts = module.split(".") if module else []
            chain = {".".join(parts[:i]) for i in range(len(parts) + 1)}  # the module and every ancestor
            largest = max(largest, sum(own.get(m, 0) for m in chain))
        return largest

    @property
    def largest_sub_group_numel(self) -> int:
        return max((g.numel for g in self.sub_groups), default=0)


def decay_order(decays: Sequence[float | None], numels: Sequence[int]) -> list[int]:
    """The order the trainable parameters are laid out in, as indices into ``decays`` and ``numels`` (each one's
    weight decay and size, in model order): each decay's parameters together, in model order, the decay with the
    fewest elements first (ties: the order the decays first appear).

    Why the smallest first: with the usual groups that is the norms and biases every layer has. The next forward
    reads them from its first layer on, so a settled step's updates behind it (which go in layout order) make them
    first; their gradients are final only at the end of backward, so a split optimizer, which keeps the first
    sub-groups on the device, keeps them there, where no host step waits for them; and the read-ahead's guess (the
    last sub-groups first) stays the last layers' matrices."""
    runs: dict[float | None, list[int]] = {}
    for index, decay in enumerate(decays):
        runs.setdefault(decay, []).append(index)
    ordered = sorted(runs.values(), key=lambda run: sum(numels[i] for i in run))  # stable: ties keep their order
    return [index for run in ordered for index in run]


def _cut_sub_groups(trainable: list[ParamSlot], sub_group_size: int) -> tuple[SubGroup, ...]:
    runs = cut_runs([s.shard_numel for s in trainable], sub_group_size, [s.weight_decay for s in trainable])
    return tuple(SubGroup(i, trainable[run.start].offset, _round_up(trainable[run.stop - 1].end, ALIGN_NUMEL),
                          tuple(trainable[run.start:run.stop])) for i, run in enumerate(runs))


def cut_runs(shard_numels: Sequence[int], sub_group_size: int,
             decays: Sequence[float | None] | None = None) -> list[range]:
    """The sub-groups over shards of ``shard_numels`` elements packed end to end (each starting aligned), as
    index ranges: runs of whole shards of at most ``sub_group_size`` elements (one shard alone may exceed it),
    cut also where ``decays`` (each shard's weight decay) changes. The layout and the estimate both cut here."""
    runs: list[range] = []
    first = start = offset = 0
    for index, numel in enumerate(shard_numels):
        end = _round_up(offset + numel, ALIGN_NUMEL)
        if index > first and (end - start > sub_group_size or (decays is not None and decays[index] != decays[first])):
            runs.append(range(first, index))
            first, start = index, offset
        offset = end
    if len(shard_numels) > first:
        runs.append(range(first, len(shard_numels)))
    return runs


def packed_offsets(numels: list[int]) -> tuple[list[int], int]:
    """Offsets of shards of ``numels`` elements packed end to end in a buffer of their own, each at a multiple of
    ``ALIGN_NUMEL`` as in the flat spaces (a view goes to NVMe without a bounce), and the elements of the whole."""
    offsets, total = [], 0
    for numel in numels:
        offsets.append(total)
        total += _round_up(numel, ALIGN_NUMEL)
    return offsets, total


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
