"""One parameter under ZeRO-3: its full tensor comes and goes, its shard stays.

The ``nn.Parameter`` keeps its identity and dtype for its whole life. Inside a
pass its ``.data`` is a view of ``full``, a padded flat tensor whose storage is
resized to zero bytes when the parameter is released and back when it is
fetched. Autograd's saved views of the parameter share that storage, so they
see the fetched values again in backward. Between passes a released
parameter's ``.data`` is an empty tensor (as DeepSpeed's partitioned ones are),
so its full shape is the slot's, not ``param.shape``.

Fetching brings this rank's shard up into its own chunk of ``full``, then
all-gathers in place. The shard comes from device memory (gathered from
directly), from host memory (a copy up on the copy stream), or from NVMe (a
read into a pinned buffer, then a copy up). The compute stream waits on the
copy's event, never the host; a prefetch starts the read or the copy early.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from infinity.params.compute_shards import ComputeShards
from infinity.params.gathered_blocks import FreshBlocks, ReusedBlocks
from infinity.placement.copies import Copies, CopyDone
from infinity.placement.layout import ParamSlot
from infinity.placement.tiers import Tiers
from infinity.runtime.comm import Collectives
from infinity.storage import HostBufferPool

logger = logging.getLogger(__name__)


class Prefetching(Protocol):
    """What a parameter asks of the prefetcher (:class:`~infinity.params.prefetcher.Prefetcher`)."""

    def fetch_requested(self, param: ShardedParam) -> None:
        """Every fetch request, in order: the pass's trace, and the point to issue the next prefetches."""

    def keeps_gathered(self, param: ShardedParam) -> bool:
        """Keep ``param`` gathered at its release: the plan uses it again soon and the budget allows."""

    def land_in_flight(self) -> None:
        """The read pool ran dry: complete every prefetch's read and issue its copy up, so its host buffer comes
        back once that copy has landed."""


class PendingUpdate(Protocol):
    """The last step's updates still to deliver new shards behind the forward (:class:`~infinity.optim.step_tail.StepTail`)."""

    def delivered(self, slot_index: int) -> bool:
        """The slot's new compute shard is on its way home (a fetch issued now reads it), or there is no update
        for it."""

    def wait_for(self, slot_index: int) -> None:
        """Before a fetch of the slot's shard: its sub-group's update has delivered it; raises while the
        updates' failure stands."""


def needs_swap_in(shards: ComputeShards, slot: ParamSlot) -> bool:
    """The slot's shard rests on NVMe: fetching it starts with a read."""
    return shards.resident(slot) is None


def needs_copy_up(shards: ComputeShards, copies: Copies, slot: ParamSlot) -> bool:
    """The slot's shard is not in device memory: fetching it crosses (or swaps in)."""
    return copies.distinct and not shards.resident_in_device_memory(slot)


class ParamState(enum.Enum):
    RELEASED = "released"   # only the shard exists
    FETCHING = "fetching"   # the full tensor is allocated; its shard's swap-in or copy up is in flight (prefetch)
    FETCHED = "fetched"     # the full tensor is in device memory


@dataclass(frozen=True, slots=True)
class FetchPath:
    """What every parameter fetches and releases through, shared by all of them."""

    shards: ComputeShards
    comm: Collectives
    tiers: Tiers
    copies: Copies
    read_pool: HostBufferPool | None
    """Host buffers an NVMe shard is read into before it crosses up (None: read in place)."""
    blocks: FreshBlocks | ReusedBlocks
    prefetcher: Prefetching | None = None


class ShardedParam:
    """A parameter's full tensor, its state, and the verbs that move between states."""

    def __init__(self, param: torch.nn.Parameter, slot: ParamSlot, path: FetchPath, *, persistent: bool):
        self.param = param
        self.slot = slot
        self.name = slot.name
        self._shards = path.shards
        self._comm = path.comm
        self._tiers = path.tiers
        self._copies = path.copies
        self._read_pool = path.read_pool
        self._blocks = path.blocks
        """Where the full tensor's bytes come from at a fetch and go at a release."""
        self.persistent = persistent
        self.holders = 0
        self.stale = True  # the full tensor no longer matches the shard (set after each optimizer step)
        self._tail: PendingUpdate | None = None  # the step updates still to deliver this shard (behind the forward)
        self._swap_in = None   # (handle, shard view, pool buffer or None) while an NVMe read is in flight
        self._copy_up: CopyDone | None = None  # the shard's copy into its chunk of `full`, once issued
        # Told of every fetch request (its trace), asked whether to keep a released parameter gathered,
        # and asked to land its prefetches when the read pool runs dry; None: fetched on demand only.
        self._prefetcher = path.prefetcher
        shards, comm, tiers = path.shards, path.comm, path.tiers
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
        self._view = self.full[:slot.numel].view(slot.shape)
        """The parameter's shape over the full tensor's bytes, made while they exist (a view of an emptied storage
        cannot be made)."""
        n = slot.shard_numel
        self._own_chunk = self.full[comm.rank * n:(comm.rank + 1) * n]
        """This rank's chunk of the full tensor: the shard lands here and is all-gathered in place (made once,
        like ``_view``; a slice at every fetch was a visible share of a small model's step)."""
        param.data = self._view
        # The full element count under the name peft's trainable-parameter counts and the Trainer's (under ZeRO-3)
        # read where a partitioned parameter's numel() is 0 between passes (DeepSpeed's name for it).
        param.ds_numel = slot.numel
        if not self.aliased:
            self.full.untyped_storage().resize_(0)
        self._empty = torch.empty(0, dtype=dtype, device=tiers.device)
        """What ``param.data`` is between passes while released (DeepSpeed's partitioned parameters are empty too)."""
        self._between_passes = False

    # -- what user code between passes sees ----------------------------------
    def leave_pass(self) -> None:
        """Until :meth:`enter_pass`, user code may touch the parameter: released, its ``.data`` is an empty tensor
        (a read says so at once), not a view of freed bytes (a read there would crash the process)."""
        self._between_passes = True
        if self.state is ParamState.RELEASED and not self.aliased:
            self.param.data = self._empty

    def enter_pass(self) -> None:
        """A forward begins: ``.data`` is the view of the full tensor that fetches fill."""
        self._between_passes = False
        self.param.data = self._view

    @property
    def full_nbytes(self) -> int:
        return self.slot.padded_numel * self.full.element_size()

    @property
    def needs_swap_in(self) -> bool:
        """Its shard rests on NVMe, so fetching it starts with a read that can be issued ahead."""
        return needs_swap_in(self._shards, self.slot)

    @property
    def needs_copy_up(self) -> bool:
        """Its shard is not in device memory: fetching it crosses (or swaps in), which can be issued ahead."""
        return needs_copy_up(self._shards, self._copies, self.slot)

    # -- verbs --------------------------------------------------------------
    def fetch(self) -> None:
        """Make the full tensor available; counted once per holder."""
        self.holders += 1
        self.wait_for_new_shard()
        up_to_date = self.state is ParamState.FETCHED and not (self.stale and not self.aliased)
        before = self.state
        if not up_to_date and self.state is not ParamState.FETCHING:  # else a prefetch has started it already
            if self.state is ParamState.RELEASED:
                self._allocate_on_demand()
            self._start_up(block=True)
            self.state = ParamState.FETCHING
        if self._prefetcher is not None:
            # After this parameter's own read: compute waits for it now, so it goes ahead of the prefetches
            # this request issues (urgent reads are served in the order they were queued).
            self._prefetcher.fetch_requested(self)
        if not up_to_date:
            own = self._finish_up()
            # every rank reaches this collective in the same program order; prefetches only read locally
            self._comm.all_gather_into(self.full, own)
            self.stale = False
            self.state = ParamState.FETCHED
            if before is not ParamState.FETCHED:
                if self._prefetcher is not None:
                    self._prefetcher.gathered(self)
                logger.debug("%s: %s -> FETCHED", self.name, before.name)
        if self._between_passes:
            # a part of the model called outside a pass (one layer, say): whole until its release
            self.param.data = self._view

    def prefetch(self) -> bool:
        """Start bringing up the shard of a released parameter that is not in device memory (an NVMe read, or
        a copy up from host memory); False if there is nothing to do or no buffer is free. The caller (the
        prefetcher) asks :attr:`new_shard_delivered` first: a shard the last step's tail has not updated yet
        is not read ahead."""
        if self.state is not ParamState.RELEASED or not (self.needs_swap_in or self.needs_copy_up):
            return False
        self._allocate()
        if not self._start_up(block=False):
            self._deallocate()
            return False
        self.state = ParamState.FETCHING
        logger.debug("%s: RELEASED -> FETCHING (%s)", self.name, "nvme->host" if self._swap_in else "host->device")
        return True

    @property
    def reading_into_buffer(self) -> bool:
        """An NVMe read of its shard into a host buffer is in flight; a copy up follows it (:meth:`advance`)."""
        return self._swap_in is not None and self._swap_in[2] is not None

    def advance(self) -> None:
        """A prefetch whose NVMe read has landed goes on to its copy up, without waiting for anything."""
        if self.reading_into_buffer and self._swap_in[0].done():
            self._land()

    def release(self) -> None:
        """Drop one holder; free the full tensor when none is left (persistent parameters stay)."""
        if self.holders > 0:
            self.holders -= 1
        if self.holders == 0 and not self.persistent and not (self._prefetcher is not None and self._prefetcher.keeps_gathered(self)):
            self._free()

    def force_release(self) -> None:
        """Free the full tensor whoever holds it (end of a forward or backward pass)."""
        self.holders = 0
        if not self.persistent:
            self._free()

    def mark_stale(self, tail: PendingUpdate | None = None) -> None:
        """The shard changed (optimizer step), or will once ``tail`` has updated its sub-group: a fetched full
        tensor must be gathered again, and not before then."""
        self._tail = tail
        if not self.aliased:
            self.stale = True
            if self.state is not ParamState.RELEASED and self.holders == 0:
                self._free()  # a prefetch in flight read the old shard: drop it too

    @property
    def new_shard_delivered(self) -> bool:
        """No step update is pending for the shard: a read or copy of it issued now sees the new values."""
        return self._tail is None or self._tail.delivered(self.slot.index)

    @property
    def update_pending(self) -> bool:
        """A step's update of the shard runs behind the forward and this parameter has not waited for it yet."""
        return self._tail is not None

    def wait_for_new_shard(self) -> None:
        """The last step's tail updates the shard behind this forward: wait for it (once; an aliased shard is
        the full tensor, so this comes before anything reads it)."""
        if self._tail is not None:
            self._tail.wait_for(self.slot.index)  # raises while the tail's failure stands
            self._tail = None

    # -- internals ----------------------------------------------------------
    def _allocate(self) -> None:
        self._blocks.take(self.full.untyped_storage(), self.full_nbytes)

    def _allocate_on_demand(self) -> None:
        """The full tensor's bytes for a fetch that cannot wait: where the budget has no room, what the prefetcher
        holds by choice is given back first (the plan keeps the room this fetch needs beside what rests)."""
        try:
            self._allocate()
        except MemoryError:
            if self._prefetcher is None or not self._prefetcher.give_back_held():
                raise
            self._allocate()

    def _deallocate(self) -> None:
        self._blocks.give_back(self.full.untyped_storage())

    def _own_slot(self) -> torch.Tensor:
        """This rank's chunk of the full tensor: the shard lands here and is all-gathered in place."""
        return self._own_chunk

    def _start_up(self, *, block: bool) -> bool:
        """Begin bringing the shard up: an NVMe read, or a copy from host memory (nothing when it is in
        device memory). False if a read buffer is needed, none is free and not ``block``."""
        if self.needs_swap_in:
            return self._start_swap_in(block=block)
        if self.needs_copy_up:
            self._copy_up = self._copies.to_device(self._shards.resident(self.slot), self._own_slot())
        return True

    def _finish_up(self) -> torch.Tensor:
        """The tensor to gather from, once the compute stream may read it."""
        if self._swap_in is not None:
            self._land()
        if self._copy_up is not None:
            done, self._copy_up = self._copy_up, None
            # the gather reads the chunk the copy stream writes
            self._copies.compute_waits(done)
            return self._own_slot()
        if self.needs_swap_in:
            return self._own_slot()  # read in place (one memory)
        return self._shards.resident(self.slot)

    def _start_swap_in(self, *, block: bool) -> bool:
        """Issue the NVMe read of the shard: into its own chunk of the full tensor when that is in host
        memory, else into a host buffer copied up on landing (False if no buffer is free and not ``block``)."""
        if not self._copies.distinct:
            target, buffer = self._own_slot(), None
        else:
            nbytes = self.slot.shard_numel * self.full.element_size()
            self._copies.poll()  # buffers whose copies up have landed go back to the pool
            try:
                buffer = self._read_pool.acquire(nbytes, timeout=0)
            except MemoryError:
                if not block:
                    return False  # a prefetch never waits for a buffer
                # Buffers held by prefetched shards are given back once their copies up have landed:
                # issue those copies, wait for them, then take a buffer.
                if self._prefetcher is not None:
                    self._prefetcher.land_in_flight()
                self._copies.drain()
                buffer = self._read_pool.acquire(nbytes)
            target = buffer[:nbytes].view(self.full.dtype)
        self._swap_in = (self._shards.read(self.slot, target), target, buffer)
        return True

    def land_prefetch(self) -> None:
        """Complete a prefetch's read now and issue its copy up (its host buffer is freed once the copy has
        landed); the gather still waits for fetch()."""
        if self.reading_into_buffer:
            self._land()

    def _land(self) -> None:
        """Wait for the swap-in; copy it up to the device when it went through a host buffer."""
        handle, target, buffer = self._swap_in
        self._swap_in = None
        try:
            handle.wait()
        except BaseException:
            if buffer is not None:
                self._read_pool.release(buffer)
            raise
        if buffer is not None:
            self._copy_up = self._copies.to_device(target, self._own_slot())
            # the buffer is read by the copy stream until then
            self._copies.release_after(self._copy_up, lambda: self._read_pool.release(buffer))

    def _free(self) -> None:
        if self.aliased or self.state is ParamState.RELEASED:
            return
        if self._swap_in is not None:  # a prefetch nobody used: let the read land before freeing its target
            self._land()
        if self._copy_up is not None:
            # a copy up nobody used: the compute stream frees the chunk only after the copy has written it
            self._copies.compute_waits(self._copy_up)
            self._copy_up = None
        self._deallocate()
        logger.debug("%s: %s -> RELEASED", self.name, self.state.name)
        if self.state is ParamState.FETCHED and self._prefetcher is not None:
            self._prefetcher.freed(self)
        self.state = ParamState.RELEASED
        if self._between_passes:  # released outside a pass (a step made it stale): no view of freed bytes
            self.param.data = self._empty
