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

Blocks under the threshold (a micro-batch's activations, mostly) still come from the heap, and once freed glibc
keeps them there, in pieces the next step cannot all reuse: a 271M-parameter LoRA run on the CPU kept 0.9 GB of
freed heap, its RSS 2.25 GB where 1.37 GB were live. Where the device is the CPU, the engine gives the freed
heap back at the end of each optimizer step once more than ``FREED_HEAP_TRIM_NBYTES`` of it lie free
(:func:`give_back_freed_heap`: glibc's ``malloc_trim``, ~0.1 s there; peak RSS 2.04 GB against 2.50).

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
FREED_HEAP_TRIM_NBYTES = 256 << 20
"""Freed heap (glibc's ``fordblks``, every arena) above which :func:`give_back_freed_heap` returns it. Under it the
pages' refaults cost more than they give: at 64 MiB, ``infinity train``'s 3M-parameter default trimmed every few
steps and ran 7 % slower for 100 MiB less RSS."""

_done = False
_libc = None


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33 and later): every field a ``size_t``."""

    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _glibc():
    """glibc, or None where malloc is not tuned (turned off, not Linux, not glibc)."""
    global _libc
    if _libc is None:
        _libc = False
        if os.environ.get("INFINITY_MALLOC_TUNING", "1") != "0" and sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                libc.mallopt  # noqa: B018 (glibc's, not musl's without it)
                _libc = libc
            except (OSError, AttributeError):
                pass
    return _libc or None


def keep_large_blocks_mapped() -> bool:
    """Fix glibc's mmap threshold (once per process); False where that is not possible or turned off."""
    global _done
    if _done:
        return True
    libc = _glibc()
    if libc is None:  # turned off, or not glibc (musl, say): nothing to tune
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_NBYTES) == 1
    if ok:
        logger.info("malloc: blocks of %d MiB or more get their own mapping (INFINITY_MALLOC_TUNING=0 to turn off)",
                    MMAP_THRESHOLD_NBYTES >> 20)
    _done = ok
    return ok


def give_back_freed_heap(min_nbytes: int = FREED_HEAP_TRIM_NBYTES) -> int:
    """Return the heap's freed pages to the system (``malloc_trim``) when more than ``min_nbytes`` lie freed in
    it; the freed bytes there were, or 0 when nothing was done (less freed, turned off, no ``mallinfo2``)."""
    libc = _glibc()
    mallinfo2 = getattr(libc, "mallinfo2", None) if libc is not None else None
    if mallinfo2 is None:
        return 0
    mallinfo2.restype = _MallInfo2
    freed = int(mallinfo2().fordblks)
    if freed <= min_nbytes:
        return 0
    libc.malloc_trim(ctypes.c_size_t(0))
    logger.debug("malloc: %d MiB of freed heap given back", freed >> 20)
    return freed
