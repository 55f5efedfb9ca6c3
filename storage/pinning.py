"""Page-locking host buffers for the GPU, now or on a thread of its own.

Pinning costs about a third of a second per GB (the pages are faulted in and
locked, ``cudaHostRegister``): 28 GB of staging and shards took 9 s of
``initialize`` on an H100 machine. Nothing needs a buffer pinned to be
correct: a copy from pageable memory is synchronous, one from pinned memory
can overlap compute. So the engine hands its buffers to a
:class:`BackgroundPinner`, which registers them behind ``initialize`` and the
first steps; until a buffer's turn its copies are merely synchronous.

A pinner is anything with ``pin(owner, ptr, nbytes)``: ``owner`` is the object
whose life bounds the memory (a weak reference is kept; a buffer that dies
before its turn is skipped, one that dies after is unregistered).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from typing import Callable, Protocol

from .stats import format_nbytes

logger = logging.getLogger(__name__)

__all__ = ["Pinner", "ImmediatePinner", "BackgroundPinner", "cuda_register", "cuda_unregister"]


class Pinner(Protocol):
    def pin(self, owner: object, ptr: int, nbytes: int) -> None:
        """Page-lock ``[ptr, ptr + nbytes)``, which lives as long as ``owner``."""


def cuda_register(ptr: int, nbytes: int) -> None:
    import torch

    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)  # 0 = cudaHostRegisterDefault
    if int(err) != 0:
        raise MemoryError(f"cudaHostRegister of {nbytes} bytes ({format_nbytes(nbytes)}) failed with CUDA error "
                          f"{int(err)}")


def cuda_unregister(ptr: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(ptr)


class ImmediatePinner:
    """Registers on the caller's thread, before the buffer is handed out."""

    def __init__(self, register: Callable[[int, int], None] = cuda_register,
                 unregister: Callable[[int], None] = cuda_unregister) -> None:
        self._register, self._unregister = register, unregister

    def pin(self, owner: object, ptr: int, nbytes: int) -> None:
        self._register(ptr, nbytes)
        # Weak-reference callbacks run before the owner's memory is unmapped.
        weakref.finalize(owner, self._unregister, ptr)


class BackgroundPinner:
    """Registers buffers in the order given, on one daemon thread, so the caller never waits for it.

    :meth:`wait` blocks until every buffer handed so far is pinned (and raises the first failure);
    :meth:`close` stops the thread. The counters say how much is pinned, how much waits, and how long
    registration took."""

    def __init__(self, register: Callable[[int, int], None] = cuda_register,
                 unregister: Callable[[int], None] = cuda_unregister, *, device_index: int | None = None) -> None:
        self._register, self._unregister = register, unregister
        self._device_index = device_index
        self._cond = threading.Condition()
        self._queue: deque[tuple[weakref.ref, int, int]] = deque()
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self.pinned_nbytes = 0
        self.skipped_nbytes = 0
        self.pending_nbytes = 0
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="infinity-pinner", daemon=True)
        self._thread.start()

    def pin(self, owner: object, ptr: int, nbytes: int) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("BackgroundPinner.pin after close()")
            self._queue.append((weakref.ref(owner), ptr, nbytes))
            self.pending_nbytes += nbytes
            self._cond.notify_all()

    def wait(self) -> None:
        """Until every buffer handed so far is pinned or skipped; the first registration error is raised."""
        with self._cond:
            while self._queue or self._busy:
                self._cond.wait()
            if self._error is not None:
                raise self._error

    def close(self) -> None:
        """Stop after the buffer being registered now; the rest stay pageable (they are about to be freed)."""
        with self._cond:
            self._closed = True
            dropped = sum(nbytes for _, _, nbytes in self._queue)
            self._queue.clear()
            self.pending_nbytes -= dropped
            self._cond.notify_all()
        self._thread.join()

    def describe(self) -> str:
        return (f"{format_nbytes(self.pinned_nbytes)} pinned in {self.seconds:.1f} s on a background thread"
                + (f", {format_nbytes(self.pending_nbytes)} still to pin" if self.pending_nbytes else ""))

    def _run(self) -> None:
        if self._device_index is not None:
            import torch

            torch.cuda.set_device(self._device_index)  # registration belongs to the engine's device context
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                owner_ref, ptr, nbytes = self._queue.popleft()
                self._busy = True
            self._pin_one(owner_ref, ptr, nbytes)
            with self._cond:
                self._busy = False
                self.pending_nbytes -= nbytes
                drained = not self._queue
                self._cond.notify_all()
            if drained and self.pinned_nbytes:
                logger.info("host buffers: %s", self.describe())

    def _pin_one(self, owner_ref: weakref.ref, ptr: int, nbytes: int) -> None:
        owner = owner_ref()  # a strong reference for the call: the memory cannot go away mid-registration
        if owner is None:
            self.skipped_nbytes += nbytes
            return
        start = time.perf_counter()
        try:
            self._register(ptr, nbytes)
        except BaseException as err:  # noqa: BLE001 - reported by wait(); the buffer stays pageable and correct
            logger.warning("pinning %s of host buffers failed: %s (they stay pageable: copies are synchronous)",
                           format_nbytes(nbytes), err)
            self._error = self._error or err
            return
        finally:
            self.seconds += time.perf_counter() - start
        weakref.finalize(owner, self._unregister, ptr)
        self.pinned_nbytes += nbytes
