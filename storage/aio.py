"""Asynchronous direct I/O: requests split into blocks and kept at a queue depth.

Two backends with one API and the same results:

``libaio`` (:mod:`.aio_libaio`)
    Linux native AIO through the ``libaio`` package's ctypes bindings: each
    worker thread owns an AIO context of ``queue_depth`` slots and submits and
    reaps blocks in batches.
``threads`` (:mod:`.aio_threads`)
    ``queue_depth * thread_count`` threads, each doing one blocking
    ``os.preadv`` / ``os.pwritev`` at a time (the GIL is released in the
    system call). Used where libaio is missing.

We say *request* for one call of :meth:`AsyncIO.pread` / :meth:`AsyncIO.pwrite`
(possibly several *segments*: buffer, length, file offset), and *block* for the
unit handed to the kernel: at most ``block_size`` bytes of one segment. A
request is :class:`~.aio_request._Request`; the queue that cuts requests into
blocks for the backend's workers and completes them is :class:`~.aio_core._Core`.
This module holds the public :class:`AsyncIO` and :class:`IOHandle` and picks
the backend.

Every block's completion is checked. A short transfer is requeued for its
remainder, ``EAGAIN`` (from submission or completion) is requeued as is; any
other failure ends the request with an ``OSError`` naming the file, the
offset and the errno, which :meth:`IOHandle.wait` raises.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import weakref
from typing import Callable, Iterable

import torch

from . import aio_libaio
from .aio_core import _Core
from .aio_libaio import _LibAIO
from .aio_request import READ, WRITE, _Request, io_error
from .buffers import ALIGNMENT
from .stats import TierStats

logger = logging.getLogger(__name__)

__all__ = ["AsyncIO", "IOHandle", "BACKENDS", "libaio_unavailable_reason", "io_error"]
# READ, WRITE, _Request and _Core are imported from here too (the swap store, tests).

BACKENDS = ("auto", "libaio", "threads")
_MAX_THREADS = 1024


# --------------------------------------------------------------------------- choosing the backend

_libaio_probe: tuple[str | None, object] | None = None
_probe_lock = threading.Lock()


def _probe_libaio() -> tuple[str | None, _LibAIO | None]:
    global _libaio_probe
    with _probe_lock:
        if _libaio_probe is None:
            try:
                _libaio_probe = (None, aio_libaio.load())
            except ImportError as exc:
                _libaio_probe = (f"the libaio package is not installed ({exc})", None)
            except OSError as exc:
                _libaio_probe = (f"libaio does not work here ({exc})", None)
        return _libaio_probe  # type: ignore[return-value]


def libaio_unavailable_reason() -> str | None:
    """``None`` when the libaio backend works here, else why not."""
    return _probe_libaio()[0]


def _resolve_backend(backend: str) -> tuple[str, _LibAIO | None]:
    if backend not in BACKENDS:
        raise ValueError(f"AsyncIO: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "threads":
        return "threads", None
    reason, lib = _probe_libaio()
    if reason is None:
        return "libaio", lib
    if backend == "libaio":
        raise OSError(errno.ENOTSUP, f"the libaio backend was asked for but {reason}")
    logger.info("storage I/O uses the threads backend: %s", reason)
    return "threads", None


# --------------------------------------------------------------------------- handles


class IOHandle:
    """Completion of one or more requests.

    :meth:`wait` blocks until every request is done and raises the ``OSError``
    of the first that failed; :meth:`done` polls. ``finalize`` (the swap store
    copies bounce buffers with it) runs exactly once, in the first thread that
    sees the handle done.
    """

    __slots__ = ("_requests", "_finalize", "_finalized", "_error", "_stats", "_lock", "__weakref__")

    def __init__(
        self,
        requests: Iterable[_Request] = (),
        *,
        finalize: Callable[[OSError | None], OSError | None] | None = None,
        stats: TierStats | None = None,
    ) -> None:
        self._requests = tuple(requests)
        self._finalize = finalize
        self._finalized = False
        self._error: OSError | None = None
        self._stats = stats
        self._lock = threading.Lock()

    def done(self) -> bool:
        """True when every request has completed (successfully or not); never blocks on I/O."""
        if not all(r.event.is_set() for r in self._requests):
            return False
        self._run_finalize()
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Block until done; raise the first request's ``OSError``; ``TimeoutError`` after ``timeout`` s."""
        self._wait(timeout)
        if self._error is not None:
            raise self._error

    def error(self) -> OSError | None:
        """The failure, once done (``None`` while in flight or on success)."""
        return self._error if self.done() else None

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._requests)

    def interval(self) -> tuple[float, float] | None:
        """``(submitted, completed)`` in ``time.perf_counter`` seconds once done, else None (for timelines)."""
        if not self._requests or not all(r.event.is_set() for r in self._requests):
            return None
        return min(r.submitted_s for r in self._requests), max(r.completed_s for r in self._requests)

    def _wait(self, timeout: float | None = None) -> None:
        start = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for r in self._requests:
                if r.event.is_set():
                    continue
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not r.event.wait(left):
                    raise TimeoutError(f"I/O on {r.path} not done after {timeout} s")
        finally:
            if self._stats is not None:
                self._stats.record_wait(time.perf_counter() - start)
        self._run_finalize()

    def _run_finalize(self) -> None:
        if self._finalized:
            return
        with self._lock:
            if self._finalized:
                return
            error = next((r.error for r in self._requests if r.error is not None), None)
            if self._finalize is not None:
                error = self._finalize(error) or error
                self._finalize = None
            self._error = error
            self._finalized = True

    def __repr__(self) -> str:
        state = "done" if all(r.event.is_set() for r in self._requests) else "in flight"
        nbytes = sum(r.nbytes for r in self._requests)
        return f"<IOHandle {len(self._requests)} request(s), {nbytes} bytes, {state}>"


# --------------------------------------------------------------------------- the engine


def _fd_path(fd: int) -> str:
    """The file behind ``fd``, for error messages."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"<fd {fd}>"


class AsyncIO:
    """Asynchronous direct I/O over aligned buffers.

    ``block_size`` bytes per kernel request (a multiple of 4096), at most
    ``queue_depth`` of them in flight per thread, ``thread_count`` threads
    (libaio: one AIO context each; threads: ``queue_depth`` workers each).
    ``single_submit`` submits one control block per ``io_submit``;
    ``overlap_events=False`` waits for a whole batch before submitting more.
    ``backend='auto'`` picks libaio when the package and the system library
    work, else threads (one INFO line says why). Call :meth:`close` (or use a
    ``with`` block) when done; it waits for the requests in flight.
    """

    def __init__(
        self,
        backend: str = "auto",
        *,
        block_size: int = 1 << 20,
        queue_depth: int = 32,
        thread_count: int = 1,
        single_submit: bool = False,
        overlap_events: bool = True,
        stats: TierStats | None = None,
    ) -> None:
        if block_size <= 0 or block_size % ALIGNMENT:
            raise ValueError(f"AsyncIO: block_size must be a positive multiple of {ALIGNMENT}, got {block_size}")
        if queue_depth < 1 or thread_count < 1 or queue_depth * thread_count > _MAX_THREADS:
            raise ValueError(
                f"AsyncIO: need queue_depth >= 1 and thread_count >= 1 with queue_depth * thread_count <= "
                f"{_MAX_THREADS}, got queue_depth={queue_depth}, thread_count={thread_count}"
            )
        name, lib = _resolve_backend(backend)
        self.backend = name
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.thread_count = thread_count
        self.single_submit = single_submit
        self.overlap_events = overlap_events
        self.stats = stats
        self._core = _Core(name, lib, block_size, queue_depth, thread_count, single_submit, overlap_events)
        self._finalizer = weakref.finalize(self, self._core.close)
        logger.debug("AsyncIO: %s backend, block %d B, queue depth %d, %d thread(s)", name, block_size,
                     queue_depth, thread_count)  # fmt: skip

    # -- public API ------------------------------------------------------------

    def pwrite(self, file: int | str | os.PathLike, buffer: torch.Tensor, offset: int = 0) -> IOHandle:
        """Write all of ``buffer`` at ``offset`` of ``file`` (an O_DIRECT fd, or a path opened here
        with ``O_CREAT | O_DIRECT``, mode 0600). Buffer address, size and offset must be 4096-aligned."""
        return self._single(WRITE, file, buffer, offset)

    def pread(self, file: int | str | os.PathLike, buffer: torch.Tensor, offset: int = 0) -> IOHandle:
        """Fill all of ``buffer`` from ``offset`` of ``file`` (an fd or a path opened here with O_DIRECT)."""
        return self._single(READ, file, buffer, offset)

    def submit(
        self,
        op: str,
        fd: int,
        segments: list[tuple[int, int, int]],
        *,
        path: str,
        keepalive: object = None,
        stats: TierStats | None = None,
        count_nbytes: int | None = None,
        urgent: bool | None = None,
        after: Iterable[_Request] = (),
    ) -> _Request:
        """Low level: queue ``segments`` of ``(address, nbytes, file_offset)`` on ``fd``.

        The caller guarantees the memory stays valid (``keepalive`` is held until
        completion) and, for an O_DIRECT fd, 4096-alignment. Returns the request,
        to be wrapped in an :class:`IOHandle`. ``urgent`` (default: reads are, writes are not) puts the
        request ahead of queued requests that are not urgent; ``after`` holds it, without blocking
        the caller, until those requests have finished.
        """
        if op not in (READ, WRITE):
            raise ValueError(f"AsyncIO.submit: op must be {READ!r} or {WRITE!r}, got {op!r}")
        req = _Request(op, fd, path, [s for s in segments if s[1] > 0], keepalive,
                       stats if stats is not None else self.stats, False)  # fmt: skip
        if count_nbytes is not None:
            req.count_nbytes = count_nbytes
        if urgent is not None:
            req.urgent = urgent
        self._core.submit(req, after)
        return req

    def cancel(self, handle: IOHandle) -> None:
        """Issue no more blocks of ``handle``'s requests; it then fails with ``ECANCELED``."""
        self._core.cancel(handle._requests)

    def close(self, *, cancel: bool = False) -> None:
        """Wait for every request in flight (``cancel=True``: drop the blocks not yet issued,
        those requests fail with ``ECANCELED``), then stop the workers. Idempotent."""
        self._core.close(cancel)
        self._finalizer.detach()

    @property
    def closed(self) -> bool:
        return self._core.closed

    def __enter__(self) -> "AsyncIO":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"AsyncIO(backend={self.backend!r}, block_size={self.block_size}, queue_depth={self.queue_depth}, "
            f"thread_count={self.thread_count})"
        )

    # -- helpers -----------------------------------------------------------------

    def _single(self, op: str, file, buffer: torch.Tensor, offset: int) -> IOHandle:
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError(f"AsyncIO.{'p' + op}: buffer must be a contiguous CPU tensor")
        addr, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        if addr % ALIGNMENT or nbytes % ALIGNMENT or offset % ALIGNMENT or offset < 0:
            raise ValueError(
                f"AsyncIO.{'p' + op}: direct I/O needs a {ALIGNMENT}-aligned buffer address, size and file offset; "
                f"got address {addr:#x}, {nbytes} bytes, offset {offset} (use aligned_empty for buffers)"
            )
        close_fd = not isinstance(file, int)
        if close_fd:
            path = os.fspath(file)
            flags = (os.O_WRONLY | os.O_CREAT if op == WRITE else os.O_RDONLY) | os.O_DIRECT | os.O_CLOEXEC
            fd = os.open(path, flags, 0o600)
        else:
            fd, path = file, _fd_path(file)
        req = _Request(op, fd, str(path), [(addr, nbytes, offset)] if nbytes else [], buffer, self.stats, close_fd)
        try:
            self._core.submit(req)
        except BaseException:
            if close_fd:
                os.close(fd)
            raise
        return IOHandle([req], stats=self.stats)
