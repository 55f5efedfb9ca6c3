"""The threads backend: ``queue_depth * thread_count`` worker threads, each doing
one blocking ``os.preadv`` / ``os.pwritev`` at a time (the GIL is released in
the system call). Used where libaio is missing; same API and results.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import time
from typing import Callable

from .aio_request import READ, BlockQueue, _Request, io_error


class ThreadsBackend:
    """Worker threads for a :class:`~.aio_request.BlockQueue`; they hold nothing to release."""

    def worker_loops(self, core: BlockQueue) -> list[tuple[str, Callable[[], None]]]:
        n = core.queue_depth * core.thread_count
        return [(f"infinity-io-{i}", functools.partial(_worker, core)) for i in range(n)]

    def close(self) -> None:
        pass


def _worker(core: BlockQueue) -> None:
    """One worker: take a block, transfer it, report it; return once the queue stops and is empty."""
    cond = core.cond
    while True:
        with cond:
            while not core.queue:
                if core.stopping:
                    return
                cond.wait()
            ((req, addr, n, off),) = core.take_blocks(1)
        error = _transfer(req, addr, n, off)
        with cond:
            core.complete(req, error)


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
