"""Where each key's bytes live in a swap file: aligned extents, reused when freed.

Best fit over a sorted list of free extents, neighbours coalesced on free, and
a free extent that reaches the end of the file shrinks the file instead, so a
long run's swap file stops growing once its working set is reached.
"""

from __future__ import annotations

import bisect
import logging

logger = logging.getLogger(__name__)

__all__ = ["ExtentAllocator"]


class ExtentAllocator:
    """Offsets for extents of given sizes in one file; ``end`` is the size the file needs.

    Not thread-safe: the swap store calls it under its own lock.
    """

    def __init__(self, alignment: int = 4096) -> None:
        self.alignment = alignment
        self.end = 0
        self._free_offsets: list[int] = []  # sorted
        self._free_size: dict[int, int] = {}  # offset -> size

    @property
    def free_nbytes(self) -> int:
        """Bytes below ``end`` not held by any extent."""
        return sum(self._free_size.values())

    def allocate(self, nbytes: int) -> int:
        """The offset of a new extent of ``nbytes`` (a positive multiple of the alignment)."""
        if nbytes <= 0 or nbytes % self.alignment:
            raise ValueError(f"extent size must be a positive multiple of {self.alignment}, got {nbytes}")
        best = None
        for offset in self._free_offsets:
            size = self._free_size[offset]
            if size >= nbytes and (best is None or size < self._free_size[best]):
                best = offset
                if size == nbytes:
                    break
        if best is None:
            offset, self.end = self.end, self.end + nbytes
            return offset
        size = self._free_size.pop(best)
        self._free_offsets.remove(best)
        if size > nbytes:
            self._insert(best + nbytes, size - nbytes)
        return best

    def free(self, offset: int, nbytes: int) -> None:
        """Give back the extent at ``offset``; merges with free neighbours, trims the end."""
        if offset < 0 or nbytes <= 0 or offset + nbytes > self.end:
            raise ValueError(f"freeing extent [{offset}, {offset + nbytes}) outside the file's {self.end} bytes")
        i = bisect.bisect_left(self._free_offsets, offset)
        if i < len(self._free_offsets) and self._free_offsets[i] < offset + nbytes:
            raise ValueError(f"extent [{offset}, {offset + nbytes}) is already free")
        if i > 0:  # merge with the free extent just before
            prev = self._free_offsets[i - 1]
            if prev + self._free_size[prev] > offset:
                raise ValueError(f"extent [{offset}, {offset + nbytes}) is already free")
            if prev + self._free_size[prev] == offset:
                nbytes += self._free_size.pop(prev)
                offset = prev
                del self._free_offsets[i - 1]
                i -= 1
        if i < len(self._free_offsets) and self._free_offsets[i] == offset + nbytes:  # and the one after
            nxt = self._free_offsets.pop(i)
            nbytes += self._free_size.pop(nxt)
        if offset + nbytes == self.end:
            self.end = offset
        else:
            self._insert(offset, nbytes)

    def _insert(self, offset: int, nbytes: int) -> None:
        bisect.insort(self._free_offsets, offset)
        self._free_size[offset] = nbytes
