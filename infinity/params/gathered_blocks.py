"""Memory for gathered parameters: where a full tensor's storage gets its
bytes when a parameter is fetched, and where they go when it is released.

A released parameter keeps its storage object (autograd's saved views hold
it) with no bytes; a fetch gives it ``full_nbytes`` again. On a GPU that is
``resize_``, and PyTorch's caching allocator reuses device blocks. Where the
device is the CPU, ``resize_`` asks the CPU allocator, which maps fresh pages
for large blocks, and the kernel zeroes every page on first touch: the NVMe
read into it or the gather pays for that, every fetch (0.3-0.4 s a GB on the
development machines; a 303M model in bf16 fetches 1.2 GB a step).
:class:`ReusedBlocks` keeps released blocks and hands them to the next fetch
of the same size instead, by swapping the block's bytes into the storage.

Both count the device tier. Kept blocks are device bytes too, so they are
counted while kept, and only as many are kept as leave the gathered
parameters' bytes (in use + kept) at or below the most they have been in use:
the device tier's peak is what it would be without reuse.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

from infinity.placement.placement import Placement
from infinity.storage import TierStats, aligned_storage

GATHERED = "gathered parameters"
"""The owner full tensors' bytes are counted under (in use, or kept for the next fetch)."""


class FreshBlocks:
    """A full tensor's bytes from the allocator at each fetch (``resize_``), given back at each release."""

    def __init__(self, stats: TierStats):
        self._stats = stats

    def take(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        self._stats.allocate(nbytes, GATHERED)
        storage.resize_(nbytes)

    def give_back(self, storage: torch.UntypedStorage) -> None:
        nbytes = storage.nbytes()
        storage.resize_(0)
        self._stats.free(nbytes, GATHERED)

    @property
    def kept_nbytes(self) -> int:
        return 0  # nothing kept: the allocator (a GPU's caching one) keeps its own, outside the tier's count

    def close(self) -> None:
        pass


class ReusedBlocks:
    """Released full-tensor blocks kept for the next fetch of the same size (device memory is host memory)."""

    def __init__(self, stats: TierStats):
        self._stats = stats
        self._lock = threading.Lock()  # fetches and releases happen on the main thread; close may not
        self._kept: dict[int, list[torch.UntypedStorage]] = defaultdict(list)
        self._kept_nbytes = 0
        self._in_use_nbytes = 0
        self._peak_in_use_nbytes = 0
        self.reused = 0
        """Fetches served by a kept block (tests and logs)."""

    @staticmethod
    def available() -> bool:
        """This torch can move a block's bytes into another storage."""
        return hasattr(torch.UntypedStorage, "_swap_data_ptr_")

    def take(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty ``storage`` ``nbytes``: a kept block of that size, else a new one."""
        with self._lock:
            blocks = self._kept.get(nbytes)
            if blocks:
                block = blocks.pop()
                self._kept_nbytes -= nbytes
                self.reused += 1
            else:
                block = self._new_block(nbytes)
            self._in_use_nbytes += nbytes
            self._peak_in_use_nbytes = max(self._peak_in_use_nbytes, self._in_use_nbytes)
        storage._swap_data_ptr_(block)  # the storage has the block's bytes; the block object none

    def give_back(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s bytes back (nothing may read or write them any more): kept for a later fetch
        while the bound allows, else freed."""
        nbytes = storage.nbytes()
        block = torch.UntypedStorage(0)
        block._swap_data_ptr_(storage)  # the storage is empty again; its views read no bytes
        with self._lock:
            self._in_use_nbytes -= nbytes
            if self._in_use_nbytes + self._kept_nbytes + nbytes <= self._peak_in_use_nbytes:
                self._kept[nbytes].append(block)
                self._kept_nbytes += nbytes
                return
        self._stats.free(nbytes, GATHERED)  # `block` goes with this frame

    def _new_block(self, nbytes: int) -> torch.UntypedStorage:
        """A new block, after dropping kept blocks of other sizes that would keep the gathered parameters' bytes
        above their peak (called with the lock held)."""
        while self._kept_nbytes and self._in_use_nbytes + self._kept_nbytes + nbytes > self._peak_in_use_nbytes:
            self._drop_one()
        try:
            self._stats.allocate(nbytes, GATHERED)
        except MemoryError:
            if not self._kept_nbytes:
                raise
            while self._kept_nbytes:  # the budget wants the kept bytes back first
                self._drop_one()
            self._stats.allocate(nbytes, GATHERED)
        # page-aligned: a compute shard read from NVMe lands in its own chunk of the block directly (a block of
        # the CPU allocator's made every read of it bounce through a buffer and a copy of the whole shard)
        return aligned_storage(nbytes)

    def _drop_one(self) -> None:
        size = max(self._kept, key=lambda n: n if self._kept[n] else -1)
        self._kept[size].pop()
        self._kept_nbytes -= size
        self._stats.free(size, GATHERED)

    @property
    def kept_nbytes(self) -> int:
        return self._kept_nbytes

    def close(self) -> None:
        with self._lock:
            while self._kept_nbytes:
                self._drop_one()


def full_blocks_for(placement: Placement, stats: TierStats) -> FreshBlocks | ReusedBlocks:
    """Released full tensors' blocks are kept for the next fetch where device memory is host memory (the CPU
    allocator would map fresh pages for each); a GPU's caching allocator already does that."""
    if placement.device.type == "cpu" and not placement.distinct and ReusedBlocks.available():
        return ReusedBlocks(stats)
    return FreshBlocks(stats)
