"""Every crossing between host and device memory, and nothing else.

A copy runs on a dedicated copy stream, so it overlaps compute; it returns a
:class:`CopyDone` that its consumer waits on — the compute stream (a stream
wait, the host is never blocked) or the host (before reading or reusing a host
buffer). The copy stream runs its copies in the order they were issued, so
waiting on a later copy covers every earlier one.

Three ways to run, chosen by the :class:`~infinity.placement.placement.Placement`:

* a GPU: a ``torch.cuda.Stream`` and CUDA events;
* the test mode (``INFINITY_DISTINCT_DEVICE=1`` without a GPU): a worker thread
  plays the copy stream, so copies really are asynchronous and a missing wait
  shows up as a wrong value (``delay_s`` makes every copy late, for tests);
* one memory (a CPU-only run): a copy is a plain ``copy_`` and nothing is counted,
  because nothing would cross.

Bytes are counted per direction: the traffic a GPU run moves over PCIe.

The compute stream is the device's current stream when the engine is made (the
default stream, unless the caller made the engine inside ``torch.cuda.stream``):
forward and backward must run on that same stream, or the waits order nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import torch

from infinity.placement.placement import Placement

logger = logging.getLogger(__name__)


class CopyDone:
    """One issued copy: completion is queried or waited on through :class:`Copies`."""

    __slots__ = ("_cuda_event", "_host_event", "_error", "_keep_alive")

    def __init__(self, cuda_event=None, host_event: threading.Event | None = None, keep_alive=()):
        self._cuda_event = cuda_event
        self._host_event = host_event
        self._error: BaseException | None = None
        self._keep_alive = keep_alive  # tensors the copy reads or writes, held until it is done

    def query(self) -> bool:
        if self._cuda_event is not None:
            return self._cuda_event.query()
        return self._host_event is None or self._host_event.is_set()

    def _host_wait(self) -> None:
        if self._cuda_event is not None:
            self._cuda_event.synchronize()
        elif self._host_event is not None:
            self._host_event.wait()
        self._keep_alive = ()
        if self._error is not None:
            error, self._error = self._error, None  # raised once, to the first waiter
            raise error


DONE = CopyDone()
"""A copy that needed no time (one memory)."""


class Copies:
    """The copy stream, its events, and the byte counts of both directions."""

    def __init__(self, placement: Placement, *, delay_s: float = 0.0):
        self.device = placement.device
        self.distinct = placement.distinct
        self.host_to_device_nbytes = 0
        self.device_to_host_nbytes = 0
        self.delay_s = delay_s
        self._lock = threading.Lock()   # counts and the release list are touched by the optimizer's worker too
        self._issue_lock = threading.Lock()  # issuing a copy and noting it as the last one (see _copy)
        self._after: list[tuple[CopyDone, Callable[[], None]]] = []
        self._last: CopyDone = DONE
        self._stream = self._compute_stream = None
        self._worker: _CopyWorker | None = None
        if self.device.type == "cuda":
            self._compute_stream = torch.cuda.current_stream(self.device)
            self._stream = torch.cuda.Stream(self.device)
        elif self.distinct:
            self._worker = _CopyWorker(self)

    # -- issuing ----------------------------------------------------------------
    def to_device(self, src_host: torch.Tensor, dst_device: torch.Tensor) -> CopyDone:
        """Copy host memory up; the compute stream waits on the result before using ``dst_device``."""
        return self._copy(src_host, dst_device, up=True)

    def to_host(self, src_device: torch.Tensor, dst_host: torch.Tensor) -> CopyDone:
        """Copy device memory down, after the compute work issued so far; the host waits before reading."""
        return self._copy(src_device, dst_host, up=False)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, *, up: bool) -> CopyDone:
        nbytes = dst.numel() * dst.element_size()
        if not self.distinct:
            dst.copy_(src)  # one memory: nothing crosses
            return DONE
        # Copies are issued from three threads (the main one, autograd's device thread, the optimizer's worker):
        # issuing and noting the last one under one lock keeps `last()` the latest in the copy stream's order.
        with self._issue_lock:
            if self._stream is not None:
                done = self._cuda_copy(src, dst, up=up)
            else:
                done = self._worker.submit(src, dst)
            self._last = done
        with self._lock:
            if up:
                self.host_to_device_nbytes += nbytes
            else:
                self.device_to_host_nbytes += nbytes
        return done

    def _cuda_copy(self, src: torch.Tensor, dst: torch.Tensor, *, up: bool) -> CopyDone:
        # The copy waits for the compute work issued so far: a slice going down is produced by it, and
        # memory coming up may have been read by it (a shard) or freed by it a moment ago (a fresh block).
        self._stream.wait_stream(self._compute_stream)
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
        device_tensor, host_tensor = (dst, src) if up else (src, dst)
        # The compute stream may free the device tensor before the copy ran: keep its block until then.
        device_tensor.record_stream(self._stream)
        event = torch.cuda.Event()
        event.record(self._stream)
        # The host tensor is held until a wait on the copy (the allocator knows nothing of it); the device one
        # is not, so that its block goes back to the caching allocator as soon as its owner lets go of it.
        return CopyDone(cuda_event=event, keep_alive=(host_tensor,))

    # -- waiting ------------------------------------------------------------------
    def compute_waits(self, done: CopyDone) -> None:
        """The compute stream will not run past this point until ``done`` has landed."""
        if done._cuda_event is not None:
            # a stream wait: the host goes on issuing work
            self._compute_stream.wait_event(done._cuda_event)
        else:
            # without a GPU, compute is the host thread itself
            done._host_wait()

    def host_waits(self, done: CopyDone) -> None:
        """Block the calling thread until ``done`` has landed (before reading or reusing a host buffer)."""
        done._host_wait()

    def last(self) -> CopyDone:
        """The latest copy issued: waiting on it covers every copy issued before it."""
        return self._last

    # -- releasing buffers after their copy -------------------------------------
    def release_after(self, done: CopyDone, release: Callable[[], None]) -> None:
        """Run ``release`` (give a buffer back) once ``done`` has landed, without waiting for it now."""
        if done.query():
            release()
            return
        with self._lock:
            self._after.append((done, release))

    def poll(self) -> None:
        """Run the releases whose copies have landed."""
        with self._lock:
            ready, waiting = [], []
            for entry in self._after:
                (ready if entry[0].query() else waiting).append(entry)
            self._after = waiting
        for _, release in ready:
            release()

    def drain(self) -> None:
        """Wait for every copy issued, and run every pending release."""
        self._last._host_wait()
        with self._lock:
            pending, self._after = self._after, []
        for done, release in pending:
            done._host_wait()
            release()

    def snapshot(self) -> dict:
        with self._lock:
            return {"host_to_device_nbytes": self.host_to_device_nbytes,
                    "device_to_host_nbytes": self.device_to_host_nbytes}

    def close(self) -> None:
        try:
            self.drain()
        finally:
            if self._worker is not None:
                self._worker.close()
                self._worker = None


class _CopyWorker:
    """The copy stream of the test mode: one thread running copies in issue order."""

    def __init__(self, copies: Copies):
        self._copies = copies
        self._jobs: "queue.Queue[tuple | None]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="infinity-copy-stream", daemon=True)
        self._thread.start()

    def submit(self, src: torch.Tensor, dst: torch.Tensor) -> CopyDone:
        done = CopyDone(host_event=threading.Event(), keep_alive=(src, dst))
        self._jobs.put((src, dst, done))
        return done

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            src, dst, done = job
            try:
                if self._copies.delay_s:
                    time.sleep(self._copies.delay_s)  # a late copy: readers that do not wait see old values
                dst.copy_(src)
            except BaseException as err:  # handed to whoever waits on it
                done._error = err
                logger.error("copy of %d bytes failed: %s", dst.numel() * dst.element_size(), err)
            # The copy has run: its tensors may go now, not when somebody waits on it (the last copy's
            # stay referenced by Copies.last() until the next one; a gradient going down is a whole tensor).
            done._keep_alive = ()
            del src, dst, job
            done._host_event.set()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
