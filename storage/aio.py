"""Asynchronous direct I/O: requests split into blocks and kept at a queue depth.

Two backends with one API and the same results:

``libaio``
    Linux native AIO through the ``libaio`` package's ctypes bindings. Each
    worker thread owns an AIO context of ``queue_depth`` slots; it submits all
    the blocks it can in one ``io_submit`` and reaps up to ``queue_depth``
    completions per ``io_getevents``. The control blocks live in one
    preallocated ctypes array and are filled with ``struct.pack_into``, so a
    block costs no Python objects beyond a tuple.
``threads``
    ``queue_depth * thread_count`` threads, each doing one blocking
    ``os.preadv`` / ``os.pwritev`` at a time (the GIL is released in the
    system call). Used where libaio is missing.

We say *request* for one call of :meth:`AsyncIO.pread` / :meth:`AsyncIO.pwrite`
(possibly several *segments*: buffer, length, file offset), and *block* for the
unit handed to the kernel: at most ``block_size`` bytes of one segment.

Every block's completion is checked. A short transfer is requeued for its
remainder, ``EAGAIN`` (from submission or completion) is requeued as is; any
other failure ends the request with an ``OSError`` naming the file, the
offset and the errno, which :meth:`IOHandle.wait` raises.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import os
import struct
import threading
import time
import weakref
from typing import Callable, Iterable

import torch

from .buffers import ALIGNMENT
from .stats import TierStats

logger = logging.getLogger(__name__)

__all__ = ["AsyncIO", "IOHandle", "BACKENDS", "libaio_unavailable_reason", "io_error"]

BACKENDS = ("auto", "libaio", "threads")
READ, WRITE = "read", "write"
_MAX_THREADS = 1024


def io_error(err: int, op: str, nbytes: int, offset: int, path: str, detail: str | None = None) -> OSError:
    """An ``OSError`` whose text names the errno, the operation, the offset and the file."""
    what = detail or os.strerror(err)
    exc = OSError(err, f"{what} ({op} of {nbytes} bytes at offset {offset})", path)
    exc.offset = offset  # type: ignore[attr-defined]
    return exc


# --------------------------------------------------------------------------- libaio probing

_IOCB = struct.Struct("<QIIhhIQQqQII")  # struct iocb on 64-bit little-endian Linux (64 bytes)
_EVENT = struct.Struct("<QQqq")  # struct io_event: data, obj, res, res2 (32 bytes)
_IO_CMD_PREAD, _IO_CMD_PWRITE = 0, 1
_libaio_probe: tuple[str | None, object] | None = None
_probe_lock = threading.Lock()


class _LibAIO:
    """The few libaio entry points we call, declared to return the raw ``-errno``."""

    def __init__(self, bindings) -> None:
        cdll = bindings.libaio
        self.bindings = bindings

        def fn(name: str, *argtypes):
            f = cdll._FuncPtr((name, cdll))  # a private copy: the package's own prototypes stay untouched
            f.restype = ctypes.c_int
            f.argtypes = argtypes
            return f

        vp, lg = ctypes.c_void_p, ctypes.c_long
        self.io_setup = fn("io_setup", ctypes.c_int, vp)
        self.io_destroy = fn("io_destroy", vp)
        self.io_submit = fn("io_submit", vp, lg, vp)
        self.io_getevents = fn("io_getevents", vp, lg, lg, vp, vp)

    def setup(self, depth: int) -> ctypes.c_void_p:
        ctx = ctypes.c_void_p(0)
        rc = self.io_setup(depth, ctypes.byref(ctx))
        if rc < 0:
            hint = " (raise /proc/sys/fs/aio-max-nr)" if -rc == errno.EAGAIN else ""
            raise OSError(-rc, f"io_setup({depth}) failed: {os.strerror(-rc)}{hint}")
        return ctx


def _check_layout(bindings) -> None:
    """Our packed layouts must match the package's ctypes structures."""
    iocb, common, event = bindings.iocb, bindings.io_iocb_common, bindings.io_event
    u = iocb.u.offset
    got = (
        ctypes.sizeof(iocb), iocb.data.offset, iocb.key.offset, iocb.aio_rw_flags.offset,
        iocb.aio_lio_opcode.offset, iocb.aio_fildes.offset, u + common.buf.offset,
        u + common.nbytes.offset, u + common.offset.offset, u + common.flags.offset,
        ctypes.sizeof(event), event.data.offset, event.res.offset,
    )  # fmt: skip
    want = (64, 0, 8, 12, 16, 20, 24, 32, 40, 56, 32, 0, 16)
    if got != want:
        raise OSError(errno.ENOTSUP, f"unexpected struct iocb/io_event layout {got} (want {want})")


def _probe_libaio() -> tuple[str | None, _LibAIO | None]:
    global _libaio_probe
    with _probe_lock:
        if _libaio_probe is None:
            try:
                import libaio.libaio as bindings  # loads the system library

                _check_layout(bindings)
                lib = _LibAIO(bindings)
                ctx = lib.setup(1)
                lib.io_destroy(ctx)
                _libaio_probe = (None, lib)
            except ImportError as exc:
                _libaio_probe = (f"the libaio package is not installed ({exc})", None)
            except OSError as exc:
                _libaio_probe = (f"libaio does not work here ({exc})", None)
        return _libaio_probe  # type: ignore[return-value]


def libaio_unavailable_reason() -> str | None:
    """``None`` when the libaio backend works here, else why not."""
    return _probe_libaio()[0]


# --------------------------------------------------------------------------- requests and handles


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


class _Core:
    """The queue of requests and the worker threads; separate from :class:`AsyncIO` so that
    the workers do not keep the public object alive (its finalizer closes the core)."""

    def __init__(self, backend, lib, block_size, queue_depth, thread_count, single_submit, overlap_events):
        self.backend = backend
        self.lib: _LibAIO | None = lib
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
        self.contexts: list[ctypes.c_void_p] = []

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
        for ctx in self.contexts:
            self.lib.io_destroy(ctx)
        self.contexts.clear()
        self.closed = True

    # -- workers ---------------------------------------------------------------

    def _start_workers(self) -> None:
        if self.backend == "libaio":
            for i in range(self.thread_count):
                ctx = self.lib.setup(self.queue_depth)
                self.contexts.append(ctx)
                self.workers.append(threading.Thread(target=self._run_worker, args=(self._libaio_worker, ctx),
                                                     daemon=True, name=f"infinity-aio-{i}"))  # fmt: skip
        else:
            n = self.queue_depth * self.thread_count
            for i in range(n):
                self.workers.append(threading.Thread(target=self._run_worker, args=(self._threads_worker,),
                                                     daemon=True, name=f"infinity-io-{i}"))  # fmt: skip
        for t in self.workers:
            t.start()

    def _run_worker(self, loop, *args) -> None:
        try:
            loop(*args)
        except BaseException:  # a bug, not an I/O error (those end their request): fail loudly, not hang
            logger.exception("storage I/O worker %s died; failing the queued requests", threading.current_thread().name)
            with self.cond:
                self.stopping = True
            self.cancel(list(self.queue))
            raise

    def _threads_worker(self) -> None:
        cond = self.cond
        while True:
            with cond:
                while not self.queue:
                    if self.stopping:
                        return
                    cond.wait()
                ((req, addr, n, off),) = self.take_blocks(1)
            error = self._transfer(req, addr, n, off)
            with cond:
                self.complete(req, error)

    @staticmethod
    def _transfer(req: _Request, addr: int, n: int, off: int) -> OSError | None:
        """One block with blocking preadv/pwritev; short transfers and EAGAIN are retried."""
        call = os.preadv if req.op == READ else os.pwritev
        done = 0
        while done < n:
            view = (ctypes.c_char * (n - done)).from_address(addr + done)
            try:
                got = call(req.fd, [view], off + done)
            except BlockingIOError:
                time.sleep(0.0005)
                continue
            except OSError as exc:
                return io_error(exc.errno or errno.EIO, req.op, n - done, off + done, req.path)
            if got <= 0:
                return io_error(errno.EIO, req.op, n - done, off + done, req.path,
                                "unexpected end of file" if req.op == READ else "no progress")  # fmt: skip
            done += got
        return None

    def _libaio_worker(self, ctx: ctypes.c_void_p) -> None:
        lib, qd, cond = self.lib, self.queue_depth, self.cond
        iocbs = (lib.bindings.iocb * qd)()
        iocb_base = ctypes.addressof(iocbs)
        ptrs = (ctypes.c_void_p * qd)()
        events = (lib.bindings.io_event * qd)()
        ctx_v, ptrs_v, events_v = ctx.value, ctypes.addressof(ptrs), ctypes.addressof(events)
        pack_into, unpack_from = _IOCB.pack_into, _EVENT.unpack_from
        io_submit, io_getevents = lib.io_submit, lib.io_getevents
        single, overlap = self.single_submit, self.overlap_events
        slot_req: list[_Request | None] = [None] * qd
        slot_addr, slot_n, slot_off = [0] * qd, [0] * qd, [0] * qd
        free = list(range(qd - 1, -1, -1))
        ready: list[int] = []  # slots prepared, not yet accepted by io_submit
        inflight = 0

        def prep(slot: int) -> None:
            req = slot_req[slot]
            opcode = _IO_CMD_PREAD if req.op == READ else _IO_CMD_PWRITE
            pack_into(iocbs, slot * 64, slot, 0, 0, opcode, 0, req.fd, slot_addr[slot], slot_n[slot],
                      slot_off[slot], 0, 0, 0)  # fmt: skip
            ready.append(slot)

        while True:
            # 1. take new blocks while there are free slots
            if free and (overlap or (inflight == 0 and not ready)):
                with cond:
                    while inflight == 0 and not ready and not self.queue:
                        if self.stopping:
                            return
                        cond.wait()
                    blocks = self.take_blocks(len(free))
                for req, addr, n, off in blocks:
                    slot = free.pop()
                    slot_req[slot], slot_addr[slot], slot_n[slot], slot_off[slot] = req, addr, n, off
                    prep(slot)
            # 2. submit everything prepared, in one call unless single_submit
            failed: list[tuple[_Request, OSError]] = []
            while ready:
                count = 1 if single else len(ready)
                for j in range(count):
                    ptrs[j] = iocb_base + 64 * ready[j]
                rc = io_submit(ctx_v, count, ptrs_v)
                if rc > 0:
                    inflight += rc
                    del ready[:rc]
                    continue
                if rc == -errno.EAGAIN or rc == -errno.EINTR or rc == 0:
                    if inflight == 0:
                        time.sleep(0.0005)  # the kernel is out of resources and we hold none: back off
                    break  # reap, then retry what is left
                slot = ready.pop(0)  # io_submit reports the first control block's error
                failed.append((slot_req[slot], io_error(-rc, slot_req[slot].op, slot_n[slot], slot_off[slot],
                                                        slot_req[slot].path)))  # fmt: skip
                slot_req[slot] = None
                free.append(slot)
            # 3. reap: at least one completion (all of them without overlap_events)
            completions: list[tuple[_Request, OSError | None]] = failed
            if inflight:
                got = io_getevents(ctx_v, 1 if overlap else inflight, qd, events_v, None)
                if got < 0:
                    if got == -errno.EINTR:
                        got = 0
                    else:  # cannot happen with a valid context; surface it instead of spinning
                        raise OSError(-got, f"io_getevents failed: {os.strerror(-got)}")
                for i in range(got):
                    slot, _, res, _ = unpack_from(events, 32 * i)
                    inflight -= 1
                    want = slot_n[slot]
                    if res == want:
                        completions.append((slot_req[slot], None))
                    elif 0 < res < want:  # short transfer: requeue the remainder
                        slot_addr[slot] += res
                        slot_n[slot] -= res
                        slot_off[slot] += res
                        prep(slot)
                        continue
                    elif res == -errno.EAGAIN:
                        prep(slot)
                        continue
                    else:
                        req = slot_req[slot]
                        if res == 0:
                            err = io_error(errno.EIO, req.op, want, slot_off[slot], req.path,
                                           "unexpected end of file" if req.op == READ else "no progress")  # fmt: skip
                        else:
                            err = io_error(-res, req.op, want, slot_off[slot], req.path)
                        completions.append((req, err))
                    slot_req[slot] = None
                    free.append(slot)
            if completions:
                with cond:
                    for req, err in completions:
                        self.complete(req, err)


def _fd_path(fd: int) -> str:
    """The file behind ``fd``, for error messages."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"<fd {fd}>"


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
