"""One sub-group's optimizer states read and written whole, outside the step:
what checkpoints, consolidated state dicts and exports need.

The states rest in their compact form (``state_dtype``, ``infinity.kernels.compact``)
either in memory (:class:`~infinity.optim.in_memory.MemoryStates`) or in swap
files. :meth:`RestingStates.read` gives a state as fp32, or as it rests when one
tensor holds it (bf16 masters and moments: checkpoints store each state in
``compact.checkpoint_dtype``, the narrowest dtype that holds it exactly);
:meth:`RestingStates.write` takes fp32 and stores the resting form. The
conversions go through host buffers of one state's tensors, freed at once.

The caller (:class:`~infinity.optim.offload_optimizer.OffloadOptimizer`) makes sure no
step is updating the sub-group meanwhile.
"""

from __future__ import annotations

from typing import Callable

import torch

from infinity import kernels
from infinity.kernels.compact import STATE_NAMES
from infinity.optim.in_memory import MemoryStates
from infinity.placement.layout import SubGroup
from infinity.placement.tiers import Tiers


class RestingStates:
    def __init__(self, state_dtype: str, tiers: Tiers, memory_of: Callable[[SubGroup], "MemoryStates | None"], store,
                 key: Callable[[str, SubGroup], str]):
        """``memory_of(group)``: the states in memory that hold a sub-group, None for one on NVMe."""
        self._state_dtype = state_dtype
        self._tiers = tiers
        self._memory_of = memory_of
        self._store = store  # the swap store of the sub-groups not in memory (None when all are)
        self._key = key      # a state tensor's swap key (the optimizer's: it knows which side is current)

    def read(self, name: str, group: SubGroup, out: torch.Tensor, *, moments_written: bool) -> None:
        """Copy one state (``master``, ``exp_avg``, ``exp_avg_sq``) of a sub-group into ``out`` (group.numel
        elements): fp32, or the dtype the state rests in when one tensor holds it. Before the first step
        (``moments_written`` false) a swapped sub-group's moments are zeros: nothing is on disk yet."""
        _check_name(name)
        parts = kernels.compact.state_parts(self._state_dtype, name)
        resting_dtype = next(spec.dtype for spec in self._layout(group) if spec.name == name)
        if self._memory_of(group) is None and name != "master" and not moments_written:
            out.zero_()
        elif parts == (name,) and out.dtype == resting_dtype:
            self._read_part(name, group, out)
        elif out.dtype == torch.float32:
            tensors = self._read_parts(group, parts)
            try:
                kernels.compact.state_to_fp32_into(self._state_dtype, name, tensors, out)
            finally:
                for tensor in tensors.values():
                    self._tiers.free("host", tensor)
        else:
            raise ValueError(f"optimizer state {name} rests as {self._state_dtype}: it is read as fp32"
                             + (f" or {resting_dtype}" if parts == (name,) else "") + f", not {out.dtype}")

    def write(self, name: str, group: SubGroup, values: torch.Tensor) -> None:
        """Replace one state of a sub-group with fp32 ``values``, stored in its resting form."""
        _check_name(name)
        if values.numel() != group.numel or values.dtype != torch.float32:
            raise ValueError(f"optimizer state {name} of sub-group {group.index}: expected {group.numel} fp32 "
                             f"elements, got {values.numel()} {values.dtype}")
        if self._state_dtype == "fp32":
            parts, buffers = {name: values.contiguous()}, {}
        else:  # converted into host buffers a chunk at a time (bounded temporaries)
            names = kernels.compact.state_parts(self._state_dtype, name)
            parts = buffers = {spec.name: self._tiers.empty("host", spec.numel, spec.dtype, owner="state streaming")
                               for spec in self._layout(group) if spec.name in names}
        try:
            if buffers:
                kernels.compact.state_from_fp32_into(self._state_dtype, name, values, buffers)
            for part, tensor in parts.items():
                memory = self._memory_of(group)
                if memory is not None:
                    memory.write(part, group, tensor)
                else:
                    self._store.write(self._key(part, group), tensor).wait()
        finally:
            for tensor in buffers.values():
                self._tiers.free("host", tensor)

    def _layout(self, group: SubGroup):
        return kernels.state_layout(self._state_dtype, group.numel)

    def _read_parts(self, group: SubGroup, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """A sub-group's state tensors ``names`` in their resting form, in new host buffers (the caller frees
        them)."""
        parts = {}
        try:
            for spec in self._layout(group):
                if spec.name not in names:
                    continue
                parts[spec.name] = buffer = self._tiers.empty("host", spec.numel, spec.dtype, owner="state streaming")
                self._read_part(spec.name, group, buffer)
        except BaseException:
            for tensor in parts.values():
                self._tiers.free("host", tensor)
            raise
        return parts

    def _read_part(self, name: str, group: SubGroup, out: torch.Tensor) -> None:
        """One state tensor (a ``state_layout`` name) of a sub-group, as it rests, into ``out`` (blocking)."""
        memory = self._memory_of(group)
        if memory is not None:
            memory.read(name, group, out)
        else:
            self._store.read(self._key(name, group), out).wait()


def _check_name(name: str) -> None:
    if name not in STATE_NAMES:
        raise ValueError(f"unknown optimizer state {name!r}; one of {STATE_NAMES}")
