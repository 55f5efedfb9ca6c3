"""Keeping the process's host memory close to what the tiers account for.

PyTorch's CPU allocator has no cache of its own: it calls malloc and free.
glibc raises its mmap threshold each time a large block is freed (up to 32 MiB),
after which blocks of many MiB come from the heap, which is returned to the
system only from its top. An offload engine allocates and frees such blocks
all the time (a layer's full parameters, a sub-group's staging), so the heap
grows with fragmentation: here, up to a third of the model states' size on
top of what is really live. A fixed threshold keeps every block of 4 MiB or
more in its own mapping, given back on free. The price is a page fault and a
zeroed page for every page of such a block at first touch; the blocks that
come and go most, gathered parameters where the device is the CPU, are kept
for the next fetch instead (:mod:`infinity.params.gathered_blocks`).

Set ``INFINITY_MALLOC_TUNING=0`` to leave malloc alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_NBYTES = 4 << 20

_done = False


def keep_large_blocks_mapped() -> bool:
    """Fix glibc's mmap threshold (once per process); False where that is not possible or turned off."""
    global _done
    if _done:
        return True
    if os.environ.get("INFINITY_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_NBYTES) == 1
    except (OSError, AttributeError):  # not glibc (musl, say): nothing to tune
        return False
    if ok:
        logger.info("malloc: blocks of %d MiB or more get their own mapping (INFINITY_MALLOC_TUNING=0 to turn off)",
                    MMAP_THRESHOLD_NBYTES >> 20)
    _done = ok
    return ok
