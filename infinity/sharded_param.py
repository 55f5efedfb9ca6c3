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
    FETCHING = "fetching"   # the full tensor is allocated; its shard's swap-in is in flight (prefetch)
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
        self._swap_in = None   # (handle, shard view, pool buffer or None) while FETCHING
        self.on_fetch = None   # callback(self) at every fetch request (the prefetcher's trace)
        self.retain = None     # callback(self) -> bool: keep the full tensor though no one holds it
        self.on_pool_exhausted = None  # callback() that lands every prefetch in flight (GPU only)
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

    @property
    def needs_swap_in(self) -> bool:
        """Its shard rests on NVMe, so fetching it starts with a read that can be issued ahead."""
        return self._shards.resident(self.slot) is None

    # -- verbs --------------------------------------------------------------
    def fetch(self) -> None:
        """Make the full tensor available; counted once per holder."""
        self.holders += 1
        if self.on_fetch is not None:
            self.on_fetch(self)
        if self.state is ParamState.FETCHED and not (self.stale and not self.aliased):
            return
        before = self.state
        if self.state is ParamState.RELEASED:
            self._allocate()
            if self.needs_swap_in:
                self._start_swap_in(block=True)
        if self._swap_in is not None:
            self._land()
            own = self._own_slot()
        else:
            own = self._shards.resident(self.slot).to(self.full.device, non_blocking=True)
        # every rank reaches this collective in the same program order; prefetches only read locally
        self._comm.all_gather_into(self.full, own)
        self.stale = False
        self.state = ParamState.FETCHED
        if before is not ParamState.FETCHED:
            logger.debug("%s: %s -> FETCHED", self.name, before.name)

    def prefetch(self) -> bool:
        """Start swapping in the shard of a released parameter whose shard is on NVMe; False if nothing to do."""
        if self.state is not ParamState.RELEASED or not self.needs_swap_in:
            return False
        self._allocate()
        if not self._start_swap_in(block=False):
            self._deallocate()
            return False
        self.state = ParamState.FETCHING
        logger.debug("%s: RELEASED -> FETCHING (nvme->host)", self.name)
        return True

    def release(self) -> None:
        """Drop one holder; free the full tensor when none is left (persistent parameters stay)."""
        if self.holders > 0:
            self.holders -= 1
        if self.holders == 0 and not self.persistent and not (self.retain is not None and self.retain(self)):
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
            if self.state is not ParamState.RELEASED and self.holders == 0:
                self._free()  # a prefetch in flight read the old shard: drop it too

    # -- internals ----------------------------------------------------------
    def _allocate(self) -> None:
        self._tiers.stats["device"].allocate(self.full_nbytes)
        self.full.untyped_storage().resize_(self.full_nbytes)

    def _deallocate(self) -> None:
        self.full.untyped_storage().resize_(0)
        self._tiers.stats["device"].free(self.full_nbytes)

    def _own_slot(self) -> torch.Tensor:
        """This rank's chunk of the full tensor: the shard lands here and is all-gathered in place."""
        n = self.slot.shard_numel
        return self.full[self._comm.rank * n:(self._comm.rank + 1) * n]

    def _start_swap_in(self, *, block: bool) -> bool:
        """Issue the NVMe read of the shard: into its own chunk of the full tensor when that is in host
        memory, else into a host buffer copied up on landing (False if no buffer is free and not ``block``)."""
        if self.full.device.type == "cpu":
            target, buffer = self._own_slot(), None
        else:
            nbytes = self.slot.shard_numel * self.full.element_size()
            try:
                buffer = self._read_pool.acquire(nbytes, timeout=0)
            except MemoryError:
                if not block:
                    return False  # a prefetch never waits for a buffer
                # Buffers held by prefetched shards are given back when those land: land them, then wait.
                if self.on_pool_exhausted is not None:
                    self.on_pool_exhausted()
                buffer = self._read_pool.acquire(nbytes)
            target = buffer[:nbytes].view(self.full.dtype)
        self._swap_in = (self._shards.read(self.slot, target), target, buffer)
        return True

    def land_prefetch(self) -> None:
        """Complete a prefetch's read now (its host buffer is freed); the gather still waits for fetch()."""
        if self._swap_in is not None and self._swap_in[2] is not None:
            self._land()

    def _land(self) -> None:
        """Wait for the swap-in; copy it up to the device when it went through a host buffer."""
        handle, target, buffer = self._swap_in
        self._swap_in = None
        try:
            handle.wait()
            if buffer is not None:
                self._own_slot().copy_(target, non_blocking=False)
        finally:
            if buffer is not None:
                self._read_pool.release(buffer)

    def _free(self) -> None:
        if self.aliased or self.state is ParamState.RELEASED:
            return
        if self._swap_in is not None:  # a prefetch nobody used: let the read land before freeing its target
            self._land()
        self._deallocate()
        logger.debug("%s: %s -> RELEASED", self.name, self.state.name)
        self.state = ParamState.RELEASED
