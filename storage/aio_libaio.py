"""The libaio backend: Linux native AIO through the ``libaio`` package's ctypes
bindings.

Each worker thread owns an AIO context of ``queue_depth`` slots; it submits all
the blocks it can in one ``io_submit`` and reaps up to ``queue_depth``
completions per ``io_getevents``. The control blocks live in one
preallocated ctypes array and are filled with ``struct.pack_into``, so a
block costs no Python objects beyond a tuple.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import struct
import time
from typing import Callable

from .aio_request import READ, BlockQueue, _Request, io_error

_IOCB = struct.Struct("<QIIhhIQQqQII")  # struct iocb on 64-bit little-endian Linux (64 bytes)
_EVENT = struct.Struct("<QQqq")  # struct io_event: data, obj, res, res2 (32 bytes)
_IO_CMD_PREAD, _IO_CMD_PWRITE = 0, 1


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


def load() -> _LibAIO:
    """The libaio entry points, checked to work here: ``ImportError`` when the
    package is missing, ``OSError`` when the library or the kernel refuses."""
    import libaio.libaio as bindings  # loads the system library

    _check_layout(bindings)
    lib = _LibAIO(bindings)
    ctx = lib.setup(1)
    lib.io_destroy(ctx)
    return lib


class LibaioBackend:
    """Worker threads for a :class:`~.aio_request.BlockQueue`, ``thread_count`` of them,
    each with its own AIO context of ``queue_depth`` slots."""

    def __init__(self, lib: _LibAIO) -> None:
        self.lib = lib
        self.contexts: list[ctypes.c_void_p] = []

    def worker_loops(self, core: BlockQueue) -> list[tuple[str, Callable[[], None]]]:
        loops = []
        for i in range(core.thread_count):
            ctx = self.lib.setup(core.queue_depth)
            self.contexts.append(ctx)
            loops.append((f"infinity-aio-{i}", functools.partial(_worker, core, self.lib, ctx)))
        return loops

    def close(self) -> None:
        for ctx in self.contexts:
            self.lib.io_destroy(ctx)
        self.contexts.clear()


def _worker(core: BlockQueue, lib: _LibAIO, ctx: ctypes.c_void_p) -> None:
    """One worker on its own context: fill free slots with blocks, submit them, reap completions
    (requeueing short transfers and EAGAIN), report them; return once the queue stops and nothing is in flight."""
    qd, cond = core.queue_depth, core.cond
    iocbs = (lib.bindings.iocb * qd)()
    iocb_base = ctypes.addressof(iocbs)
    ptrs = (ctypes.c_void_p * qd)()
    events = (lib.bindings.io_event * qd)()
    ctx_v, ptrs_v, events_v = ctx.value, ctypes.addressof(ptrs), ctypes.addressof(events)
    pack_into, unpack_from = _IOCB.pack_into, _EVENT.unpack_from
    io_submit, io_getevents = lib.io_submit, lib.io_getevents
    single, overlap = core.single_submit, core.overlap_events
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
                while inflight == 0 and not ready and not core.queue:
                    if core.stopping:
                        return
                    cond.wait()
                blocks = core.take_blocks(len(free))
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
                    core.complete(req, err)
