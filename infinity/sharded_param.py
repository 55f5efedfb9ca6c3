"""One parameter under ZeRO-3: its full tensor comes and goes, its shard stays.

The ``nn.Parameter`` keeps its identity, shape and dtype for its whole life;
its ``.data`` is a view of ``full``, a padded flat tensor whose storage is
resized to zero bytes when the parameter is released and back when it is
fetched. Autograd's saved views of the parameter share that storage, so they
see the fetched values again in backward.
"""

from __future__ import annotations

import enum
import logging

import torch

from infinity.comm import Collectives
from infinity.compute_shards import ComputeShards
from infinity.layout import ParamSlot
from infinity.storage import HostBufferPool
from infinity.tiers import Tiers

logger = logging.getLogger(__name__)


class ParamState(enum.Enum):
    RELEASED = "released"   # only the shard exists
    FETCHED = "fetched"     # the full tensor is in device memory


class ShardedParam:
    """A parameter's full tensor, its state, and the verbs that move between states."""

    def __init__(self, param: torch.nn.Parameter, slot: ParamSlot, *, shards: ComputeShards, comm: Collectives,
                 tiers: Tiers, read_pool: HostBufferPool | None, persistent: bool):
        self.param = param
        self.slot = slot
        self.name = slot.name
        self._shards = shards
        self._comm = comm
        self._tiers = tiers
        self._read_pool = read_pool
        self.persistent = persistent
        self.holders = 0
        self.stale = True  # the full tensor no longer matches the shard (set after each optimizer step)
        dtype = shards.dtype
        # With one rank and the shard in device memory, the shard is the full tensor.
        resident = shards.resident(slot)
        self.aliased = comm.world_size == 1 and shards.tier == "device" and resident is not None
        if self.aliased:
            self.full = resident
            self.state = ParamState.FETCHED
        else:
            self.full = torch.empty(slot.padded_numel, dtype=dtype, device=tiers.device)
            self.state = ParamState.RELEASED
        param.data = self.full[:slot.numel].view(slot.shape)
        if not self.aliased:
            self.full.untyped_storage().resize_(0)

    @property
    def full_nbytes(self) -> int:
        return self.slot.padded_numel * self.full.element_size()

    # -- verbs --------------------------------------------------------------
    def fetch(self) -> None:
        """Make the full tensor available; counted once per holder."""
        self.holders += 1
        if self.state is ParamState.FETCHED and not (self.stale and not self.aliased):
            return
        if self.state is ParamState.RELEASED:
            self._tiers.stats["device"].allocate(self.full_nbytes)
            self.full.untyped_storage().resize_(self.full_nbytes)
        self._gather()
        self.stale = False
        if self.state is ParamState.RELEASED:
            logger.debug("%s: RELEASED -> FETCHED", self.name)
        self.state = ParamState.FETCHED

    def release(self) -> None:
        """Drop one holder; free the full tensor when none is left (persistent parameters stay)."""
        if self.holders > 0:
            self.holders -= 1
        if self.holders == 0 and not self.persistent:
            self._free()

    def force_release(self) -> None:
        """Free the full tensor whoever holds it (end of a forward or backward pass)."""
        self.holders = 0
        if not self.persistent:
            self._free()

    def mark_stale(self) -> None:
        """The shard changed (optimizer step): a fetched full tensor must be gathered again."""
        if not self.aliased:
            self.stale = True
            if self.state is ParamState.FETCHED and self.holders == 0:
                self._free()

    # -- internals ----------------------------------------------------------
    def _free(self) -> None:
        if self.aliased or self.state is ParamState.RELEASED:
            return
        self.full.untyped_storage().resize_(0)
        self._tiers.stats["device"].free(self.full_nbytes)
        self.state = ParamState.RELEASED
        logger.debug("%s: FETCHED -> RELEASED", self.name)

    def _gather(self) -> None:
        slot = self.slot
        shard = self._shards.resident(slot)
        if shard is not None:
            self._comm.all_gather_into(self.full, shard.to(self.full.device, non_blocking=True))
            return
        if self._comm.world_size == 1:
            self._shards.read(slot, self.full[:slot.shard_numel]).wait()
            return
        nbytes = slot.shard_numel * self.full.element_size()
        buffer = self._read_pool.acquire(nbytes)
        try:
            shard = buffer[:nbytes].view(self.full.dtype)
            self._shards.read(slot, shard).wait()
            self._comm.all_gather_into(self.full, shard.to(self.full.device, non_blocking=True))
        finally:
            self._read_pool.release(buffer)
