"""One I/O request and the error it fails with.

A *request* is one call of :meth:`AsyncIO.pread` / :meth:`AsyncIO.pwrite` (or
:meth:`AsyncIO.submit`): several *segments* ``(address, nbytes, file_offset)``,
cut into *blocks* of at most ``block_size`` bytes as the queue
(:mod:`.aio_core`) hands them to a backend. The request owns its buffer
(``keepalive``) until the kernel is done with it.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Protocol

READ, WRITE = "read", "write"


def io_error(err: int, op: str, nbytes: int, offset: int, path: str, detail: str | None = None) -> OSError:
    """An ``OSError`` whose text names the errno, the operation, the offset and the file."""
    what = detail or os.strerror(err)
    exc = OSError(err, f"{what} ({op} of {nbytes} bytes at offset {offset})", path)
    exc.offset = offset  # type: ignore[attr-defined]
    return exc


class _Request:
    """One pread/pwrite: segments ``(address, nbytes, file_offset)`` cut into blocks."""

    __slots__ = (
        "op", "fd", "path", "segments", "nbytes", "seg", "pos", "issued_all", "inflight",
        "error", "event", "keepalive", "stats", "close_fd", "count_nbytes", "submitted_s", "completed_s",
        "urgent", "held_by", "dependents",
    )  # fmt: skip

    def __init__(self, op, fd, path, segments, keepalive, stats, close_fd) -> None:
        self.op = op
        self.fd = fd
        self.path = path
        self.segments = segments
        self.nbytes = sum(n for _, n, _ in segments)
        self.seg = 0  # next segment to cut a block from
        self.pos = 0  # bytes of that segment already cut
        self.issued_all = not segments
        self.inflight = 0
        self.error: OSError | None = None
        self.event = threading.Event()
        self.keepalive = keepalive  # the caller's buffer, alive until the kernel is done with it
        self.stats = stats
        self.close_fd = close_fd
        self.count_nbytes = self.nbytes  # what `stats` records on success (the swap store counts payload bytes)
        self.submitted_s = time.perf_counter()  # for timelines: when asked for and when done
        self.completed_s: float | None = None
        self.urgent = op == READ  # someone is (or soon will be) waiting on it; see _Core.submit
        self.held_by = 0  # requests this one must follow that have not finished (see _Core.submit)
        self.dependents: list[_Request] = []  # requests held until this one finishes


class BlockQueue(Protocol):
    """What a backend's workers read of the queue (:class:`~.aio_core._Core` is the one): its sizes and flags,
    the condition that guards it, and the two verbs that hand out blocks and take back their results."""

    queue_depth: int
    thread_count: int
    single_submit: bool
    overlap_events: bool
    cond: threading.Condition
    queue: collections.deque[_Request]
    """Requests with blocks left to issue (read under ``cond``)."""
    stopping: bool
    """Set under ``cond`` when the queue closes: a worker returns once it has nothing in flight."""

    def take_blocks(self, limit: int) -> list[tuple[_Request, int, int, int]]:
        """Up to ``limit`` blocks to issue, each ``(request, address, nbytes, offset)``; called under ``cond``."""

    def complete(self, req: _Request, error: OSError | None) -> None:
        """One block of ``req`` is done (``error`` None) or failed."""
