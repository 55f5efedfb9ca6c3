"""``infinity.storage``: the tiers below the accelerator.

- :mod:`.aio`: :class:`AsyncIO`, asynchronous direct I/O (libaio, or a thread pool) returning :class:`IOHandle`.
  Its parts: :mod:`.aio_core` (the request queue), :mod:`.aio_libaio` and :mod:`.aio_threads` (the two
  backends), :mod:`.aio_request` (one request, ``io_error``).
- :mod:`.buffers`: :func:`aligned_empty`, :func:`aligned_storage` and :class:`HostBufferPool`, aligned (pinned on
  CUDA) host memory.
- :mod:`.pinning`: :class:`BackgroundPinner`, page-locking buffers on a thread of its own.
- :mod:`.swap_store`: :class:`SwapStore`, tensors by key in files under a private directory.
- :mod:`.swap_dir`: that private directory: made, probed for direct I/O, locked for the store's life, removed;
  leftovers of dead runs cleaned, never a live run's.
- :mod:`.extents`: where a key's bytes live in a swap file.
- :mod:`.stats`: :class:`TierStats`, live/peak bytes, bytes moved and time waited per tier.
- :mod:`.bench`: the bandwidth measurements behind ``infinity bench`` and ``benchmarks/bench_storage.py``.

This package imports only torch, numpy, the standard library and ``libaio``;
it knows nothing of models, parameters or ``torch.distributed``.
"""

from .aio import AsyncIO, IOHandle, libaio_unavailable_reason
from .buffers import ALIGNMENT, HostBufferPool, aligned_empty, aligned_storage
from .pinning import BackgroundPinner
from .stats import TierStats
from .swap_store import DirectIOUnsupported, SwapStore

__all__ = [
    "ALIGNMENT",
    "AsyncIO",
    "BackgroundPinner",
    "DirectIOUnsupported",
    "HostBufferPool",
    "IOHandle",
    "SwapStore",
    "TierStats",
    "aligned_empty",
    "aligned_storage",
    "libaio_unavailable_reason",
]
