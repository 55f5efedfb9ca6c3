"""Aligned (and on CUDA pinned) host buffers, and a pool of them under a byte budget.

Direct I/O needs page-aligned memory. :func:`aligned_empty` takes it straight
from the kernel with an anonymous ``mmap``: the address is page-aligned and the
mapping is exactly the requested size rounded up to 4096 bytes. On CUDA the
mapping is pinned with ``cudaHostRegister`` on that exact range, which avoids
the power-of-two rounding of PyTorch's pinned-memory caching allocator (a
1.1 GiB ``pin_memory()`` tensor holds 2 GiB).
"""

from __future__ import annotations

import logging
import mmap
import threading
import time

import torch

from .pinning import ImmediatePinner, Pinner
from .stats import TierStats, format_nbytes

logger = logging.getLogger(__name__)

__all__ = ["ALIGNMENT", "aligned_empty", "aligned_storage", "round_up", "HostBufferPool", "pinning_available"]

ALIGNMENT = 4096
"""Byte alignment of every buffer address, buffer size and file offset of direct I/O."""


def round_up(nbytes: int, multiple: int = ALIGNMENT) -> int:
    return -(-nbytes // multiple) * multiple


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


class _Mapping(mmap.mmap):
    """An anonymous private mapping; a subclass only so that it takes weak references."""


_pin_warned = False


def pinning_available() -> bool:
    return torch.cuda.is_available()


def aligned_empty(numel: int, dtype: torch.dtype, *, pin: bool = False, huge_pages: bool = True,
                  pinner: Pinner | None = None) -> torch.Tensor:
    """A 1-D uninitialized tensor whose ``data_ptr()`` is 4096-aligned.

    The underlying allocation is ``numel * itemsize`` rounded up to a multiple
    of 4096 bytes (at least 4096), so a direct transfer of the rounded size
    never leaves the allocation. With ``pin=True`` and CUDA available the
    allocation is page-locked for fast, asynchronous host-to-device copies;
    without CUDA ``pin`` is ignored (logged once). A ``pinner`` (see
    :mod:`.pinning`) takes the registration instead, e.g. on a thread of its
    own. ``huge_pages=False`` keeps the allocation on ordinary 4 KiB pages
    (the benchmark's control).
    """
    if numel < 0:
        raise ValueError(f"aligned_empty: numel must be >= 0, got {numel}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    capacity = max(round_up(nbytes), ALIGNMENT)
    mapping = _anonymous_mapping(capacity, huge_pages=huge_pages)
    flat = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive
    if pin:
        if pinner is not None:
            pinner.pin(mapping, flat.data_ptr(), capacity)
        elif pinning_available():
            ImmediatePinner().pin(mapping, flat.data_ptr(), capacity)
        else:
            global _pin_warned
            if not _pin_warned:
                logger.info("pinned host buffers requested but CUDA is not available: using pageable memory")
                _pin_warned = True
    return flat[:nbytes].view(dtype)


def aligned_storage(nbytes: int) -> torch.UntypedStorage:
    """A host storage of exactly ``nbytes`` (at least 1) whose address is page-aligned: a direct read lands in it
    without a bounce copy, where the CPU allocator's blocks are 64-byte aligned (2 MiB only for large ones, and
    only with ``THP_MEM_ALLOC_ENABLE=1`` set before torch starts). Its pages go back to the system when it is
    freed."""
    if nbytes < 1:
        raise ValueError(f"aligned_storage: nbytes must be >= 1, got {nbytes}")
    return torch.frombuffer(_anonymous_mapping(nbytes, huge_pages=True), dtype=torch.uint8).untyped_storage()


def _anonymous_mapping(nbytes: int, *, huge_pages: bool) -> _Mapping:
    mapping = _Mapping(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if huge_pages and nbytes >= _HUGE_PAGE and _MADV_HUGEPAGE is not None:
        # Transparent huge pages where the system allows them (madvise mode): fewer pages to pin per
        # transfer, and DMA into them is steadier (in VMs, markedly so).
        try:
            mapping.madvise(_MADV_HUGEPAGE)
        except OSError as exc:
            logger.debug("madvise(MADV_HUGEPAGE) on %d bytes failed: %s", nbytes, exc)
    return mapping


class HostBufferPool:
    """Aligned host buffers handed out under a byte budget that is never overshot.

    :meth:`acquire` rounds each request up to a multiple of 4096 bytes and
    counts the rounded size. When the budget is full it blocks until buffers
    are released (``timeout=None``), gives up after ``timeout`` seconds, or
    fails at once (``timeout=0``), always with ``MemoryError``. Released
    buffers are kept for reuse by requests of the same rounded size while they
    fit; kept buffers are dropped as soon as a request needs their room, so
    live plus kept bytes never pass the budget either.
    """

    def __init__(self, budget_nbytes: int, *, pin: bool = False, stats: TierStats | None = None,
                 pinner: Pinner | None = None, owner: str = "host buffer pool") -> None:
        """``owner``: what the pool's buffers are for, in the accounting of ``stats`` (by owner)."""
        if budget_nbytes < 0:
            raise ValueError(f"HostBufferPool: budget_nbytes must be >= 0, got {budget_nbytes}")
        self.budget_nbytes = int(budget_nbytes)
        self.pin = pin
        self.owner = owner
        self._pinner = pinner
        self.stats = stats if stats is not None else TierStats("host", budget_nbytes)
        self._cond = threading.Condition()
        self._live_nbytes = 0
        self._peak_nbytes = 0
        self._cached_nbytes = 0
        self._cached: dict[int, list[torch.Tensor]] = {}  # rounded size -> flat uint8 buffers
        self._handed_out: dict[int, tuple[torch.Tensor, int]] = {}  # data_ptr -> (flat buffer, rounded size)

    @property
    def live_nbytes(self) -> int:
        return self._live_nbytes

    @property
    def peak_nbytes(self) -> int:
        return self._peak_nbytes

    def acquire(self, nbytes: int, *, timeout: float | None = None) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` bytes, 4096-aligned, from the budget."""
        if nbytes < 0:
            raise ValueError(f"HostBufferPool.acquire: nbytes must be >= 0, got {nbytes}")
        rounded = max(round_up(nbytes), ALIGNMENT)
        if rounded > self.budget_nbytes:
            raise MemoryError(
                f"host buffer pool: a request of {nbytes} bytes ({format_nbytes(rounded)} once aligned) "
                f"is larger than the whole budget of {self.budget_nbytes} bytes ({format_nbytes(self.budget_nbytes)})"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._live_nbytes + rounded > self.budget_nbytes:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise MemoryError(
                        f"host buffer pool: no room for {nbytes} bytes ({format_nbytes(rounded)} aligned) "
                        f"within the budget of {format_nbytes(self.budget_nbytes)}: "
                        f"{format_nbytes(self._live_nbytes)} are in use"
                        + ("" if timeout == 0 else f" after waiting {timeout} s")
                    )
                self._cond.wait(remaining)
            buf = self._take_cached(rounded)
            if buf is None:
                self._evict(self._live_nbytes + self._cached_nbytes + rounded - self.budget_nbytes)
                buf = None
            self.stats.allocate(rounded, self.owner)  # may raise if the tier's stats carry a tighter budget
            self._live_nbytes += rounded
            self._peak_nbytes = max(self._peak_nbytes, self._live_nbytes)
        if buf is None:
            try:
                buf = aligned_empty(rounded, torch.uint8, pin=self.pin, pinner=self._pinner)
            except BaseException:
                with self._cond:
                    self._live_nbytes -= rounded
                    self.stats.free(rounded, self.owner)
                    self._cond.notify_all()
                raise
        view = buf[:nbytes]
        with self._cond:
            self._handed_out[buf.data_ptr()] = (buf, rounded)
        return view

    def release(self, buf: torch.Tensor) -> None:
        """Give back a buffer from :meth:`acquire`; it must not be used afterwards."""
        with self._cond:
            entry = self._handed_out.pop(buf.data_ptr(), None)
            if entry is None:
                raise ValueError(
                    f"host buffer pool: the buffer at {buf.data_ptr():#x} ({buf.nbytes} bytes) was not acquired "
                    "from this pool or was already released"
                )
            flat, rounded = entry
            self._live_nbytes -= rounded
            self.stats.free(rounded, self.owner)
            self._cached.setdefault(rounded, []).append(flat)
            self._cached_nbytes += rounded
            self._cond.notify_all()

    def trim(self) -> None:
        """Drop every kept (released) buffer."""
        with self._cond:
            self._evict(self._cached_nbytes)

    def _take_cached(self, rounded: int) -> torch.Tensor | None:
        bufs = self._cached.get(rounded)
        if not bufs:
            return None
        self._cached_nbytes -= rounded
        return bufs.pop()

    def _evict(self, nbytes: int) -> None:
        """Drop kept buffers, largest first, until ``nbytes`` are freed (or none are kept)."""
        for size in sorted(self._cached, reverse=True):
            bufs = self._cached[size]
            while bufs and nbytes > 0:
                bufs.pop()
                self._cached_nbytes -= size
                nbytes -= size
        self._cached = {size: bufs for size, bufs in self._cached.items() if bufs}

    def __repr__(self) -> str:
        return (
            f"HostBufferPool(budget={format_nbytes(self.budget_nbytes)}, live={format_nbytes(self._live_nbytes)}, "
            f"kept={format_nbytes(self._cached_nbytes)}, pin={self.pin})"
        )
