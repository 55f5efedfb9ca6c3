"""The request queue behind :class:`~.aio.AsyncIO`: requests wait in it, are cut
into blocks for the backend's workers, complete block by block, may be held
behind other requests, and are cancelled or drained at close.

A backend (:mod:`.aio_libaio`, :mod:`.aio_threads`) only moves blocks: its
workers take them with :meth:`_Core.take_blocks` and report each with
:meth:`_Core.complete`, both under ``_Core.cond``. Everything else about a
request (ordering, dependents, errors, stats, closing its file) is here, once.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import time
from typing import Callable, Iterable, Protocol

from .aio_libaio import LibaioBackend
from .aio_request import READ, BlockQueue, _Request, io_error
from .aio_threads import ThreadsBackend

logger = logging.getLogger(__name__)


class Backend(Protocol):
    """What the queue needs of a backend."""

    def worker_loops(self, core: BlockQueue) -> list[tuple[str, Callable[[], None]]]:
        """Acquire what the workers need; return each worker's thread name and loop. A loop
        takes blocks from ``core`` and returns once ``core.stopping`` is set and it has
        nothing in flight."""

    def close(self) -> None:
        """Release what :meth:`worker_loops` acquired; called after every loop has returned."""


class _Core:
    """The queue of requests and the worker threads; separate from :class:`AsyncIO` so that
    the workers do not keep the public object alive (its finalizer closes the core).

    ``backend`` is ``"libaio"`` (``lib`` from :func:`.aio_libaio.load`) or ``"threads"`` (``lib`` None).
    """

    def __init__(self, backend, lib, block_size, queue_depth, thread_count, single_submit, overlap_events):
        self.backend = backend
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.thread_count = thread_count
        self.single_submit = single_submit
        self.overlap_events = overlap_events
        self.cond = threading.Condition()
        self.queue: collections.deque[_Request] = collections.deque()  # requests with blocks left to issue
        self.active = 0  # requests submitted and not finished
        self.stopping = False
        self.closed = False
        self.workers: list[threading.Thread] = []
        # The backend's workers are started when the first request arrives.
        self.io_backend: Backend = LibaioBackend(lib) if backend == "libaio" else ThreadsBackend()

    # -- shared bookkeeping (under self.cond) ----------------------------------

    def take_blocks(self, limit: int) -> list[tuple[_Request, int, int, int]]:
        """Cut up to ``limit`` blocks from the front of the queue."""
        blocks = []
        queue, block_size = self.queue, self.block_size
        while queue and len(blocks) < limit:
            req = queue[0]
            addr, n, off = req.segments[req.seg]
            take = min(block_size, n - req.pos)
            blocks.append((req, addr + req.pos, take, off + req.pos))
            req.inflight += 1
            req.pos += take
            if req.pos == n:
                req.seg += 1
                req.pos = 0
                if req.seg == len(req.segments):
                    req.issued_all = True
                    queue.popleft()
        return blocks

    def complete(self, req: _Request, error: OSError | None) -> None:
        """One block of ``req`` is finished (under self.cond)."""
        req.inflight -= 1
        if error is not None:
            # Of several failed blocks, report the lowest offset: the first byte not transferred.
            if req.error is None or error.offset < req.error.offset:  # type: ignore[attr-defined]
                req.error = error
            if not req.issued_all:  # issue no more of a failed request
                req.issued_all = True
                self.queue.remove(req)
        if req.inflight == 0 and req.issued_all:
            self.finish(req)

    def finish(self, req: _Request) -> None:
        if req.close_fd:
            try:
                os.close(req.fd)
            except OSError as exc:
                logger.warning("closing %s after I/O failed: %s", req.path, exc)
        if req.error is None and req.stats is not None:
            (req.stats.record_read if req.op == READ else req.stats.record_write)(req.count_nbytes)
        req.keepalive = None
        req.completed_s = time.perf_counter()
        req.event.set()
        self.active -= 1
        self._release_dependents(req)
        self.cond.notify_all()

    def _release_dependents(self, req: _Request) -> None:
        """Queue the requests that were held until ``req`` finished (or fail them if it failed)."""
        dependents, req.dependents = req.dependents, []
        for dep in dependents:
            if dep.issued_all and dep.event.is_set():
                continue  # cancelled meanwhile
            if req.error is not None and dep.error is None:
                dep.error = io_error(errno.ECANCELED, dep.op, dep.nbytes, dep.segments[0][2] if dep.segments else 0,
                                     dep.path, f"an earlier {req.op} of the same data failed")  # fmt: skip
            dep.held_by -= 1
            if dep.held_by:
                continue
            if dep.error is not None or dep.issued_all:
                dep.issued_all = True
                self.finish(dep)
            else:
                self._enqueue(dep)

    def _enqueue(self, req: _Request) -> None:
        """Urgent requests (reads, by default) go ahead of queued ones that are not urgent, even one
        whose first blocks are already issued (blocks are cut from the front, one request's blocks are
        independent, and it resumes after): a read that compute waits for should not queue behind
        writes that nobody waits for. Order between requests on the same data is the caller's to keep
        (the swap store waits for a key's pending write before it submits a read of that key)."""
        queue = self.queue
        if not req.urgent:
            queue.append(req)
            return
        for i, queued in enumerate(queue):
            if not queued.urgent:
                queue.insert(i, req)
                return
        queue.append(req)

    def submit(self, req: _Request, after: Iterable[_Request] = ()) -> None:
        """Queue ``req``; with ``after``, hold it until those requests have finished (it fails with
        ``ECANCELED`` if one of them failed), without blocking the caller."""
        with self.cond:
            if self.closed or self.stopping:
                raise ValueError("AsyncIO: submitting I/O after close()")
            self.active += 1
            blockers = [r for r in after if not r.event.is_set()]
            failed = next((r for r in after if r.event.is_set() and r.error is not None), None)
            if failed is not None:
                req.error = io_error(errno.ECANCELED, req.op, req.nbytes, req.segments[0][2] if req.segments else 0,
                                     req.path, f"an earlier {failed.op} of the same data failed")  # fmt: skip
                req.issued_all = True
            if blockers and failed is None:
                req.held_by = len(blockers)
                for blocker in blockers:
                    blocker.dependents.append(req)
                self.cond.notify_all()
                return
            if req.issued_all:  # nothing to transfer (or failed before it started)
                self.finish(req)
                return
            self._enqueue(req)
            self.cond.notify_all()
            if not self.workers:
                self._start_workers()

    def cancel(self, requests: Iterable[_Request]) -> None:
        """Issue no more blocks of ``requests``; they finish with ``ECANCELED`` once their
        in-flight blocks are back (blocks already in the kernel are not interrupted)."""
        with self.cond:
            for req in requests:
                if req.issued_all:
                    continue
                req.issued_all = True
                if req.held_by:
                    req.held_by = 0  # no longer waits: its blockers will find it finished
                else:
                    self.queue.remove(req)
                if req.error is None:
                    req.error = io_error(errno.ECANCELED, req.op, req.nbytes, req.segments[0][2], req.path,
                                         "cancelled by close()")  # fmt: skip
                if req.inflight == 0:
                    self.finish(req)

    def close(self, cancel: bool = False) -> None:
        with self.cond:
            if self.closed:
                return
            self.stopping = True
        if cancel:
            with self.cond:
                queued = list(self.queue)
            self.cancel(queued)
        with self.cond:
            while self.active:
                self.cond.wait()
            self.cond.notify_all()
        for t in self.workers:
            t.join()
        self.io_backend.close()
        self.closed = True

    # -- workers ---------------------------------------------------------------

    def _start_workers(self) -> None:
        for name, loop in self.io_backend.worker_loops(self):
            self.workers.append(threading.Thread(target=self._run_worker, args=(loop,), daemon=True, name=name))
        for t in self.workers:
            t.start()

    def _run_worker(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException:  # a bug, not an I/O error (those end their request): fail loudly, not hang
            logger.exception("storage I/O worker %s died; failing the queued requests", threading.current_thread().name)
            with self.cond:
                self.stopping = True
            self.cancel(list(self.queue))
            raise
