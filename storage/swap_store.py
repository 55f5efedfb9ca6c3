"""Tensors swapped to files under a private directory by key, with async direct I/O.

Each key's bytes live in an aligned extent of one swap file (see
:mod:`.extents`). A tensor whose ``data_ptr`` is 4096-aligned is transferred
in place for all its whole 4096-byte blocks; its last partial block (the
*tail*) goes through a small aligned bounce buffer, zero-padded on write, so
no transfer ever touches memory past the tensor's bytes. An unaligned tensor
is bounced whole through an aligned buffer.

Operations on one key are ordered: a write waits for the key's requests in
flight, a read for the key's write in flight. Different keys proceed in
parallel, up to the I/O engine's queue depth.

The private directory itself (made, probed for direct I/O, locked, removed,
and dead runs' leftovers cleaned) is :mod:`.swap_dir`'s.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import weakref
from pathlib import Path

import torch

from .aio import READ, WRITE, AsyncIO, IOHandle
from .buffers import ALIGNMENT, aligned_empty, round_up
from .extents import ExtentAllocator
from .stats import TierStats
from .swap_dir import (_DIR_PREFIX, _SWAP_FILE,  # noqa: F401  (re-exported: callers import these from this module)
                       STALE_AFTER_S, DirectIOUnsupported, create_swap_file, direct_io_problem, lock_for_life,
                       remove_dead_stores, remove_live_swap_dirs, remove_swap_dir)

logger = logging.getLogger(__name__)

__all__ = ["SwapStore", "DirectIOUnsupported", "direct_io_problem"]


class _Extent:
    __slots__ = ("offset", "capacity", "nbytes")

    def __init__(self, offset: int, capacity: int, nbytes: int) -> None:
        self.offset = offset
        self.capacity = capacity  # bytes on disk: nbytes rounded up to 4096
        self.nbytes = nbytes


def _cleanup(io: AsyncIO | None, fd_box: list, file_path: str, dir_path: str, inflight: dict | None = None,
             lock: threading.Lock | None = None) -> None:
    """Remove what a store created; used by close() and, as a safety net, at garbage collection/exit.

    ``inflight`` (the store's key -> [(handle, op)], guarded by ``lock``): requests not yet waited for. They are
    waited for before the file is closed, since a shared I/O engine (``io`` None: not the store's to close) would
    otherwise run them on a closed (or reused) descriptor; at exit that is a write-behind the program never
    waited for."""
    if inflight:
        with lock:
            handles = [h for pending in inflight.values() for h, _ in pending]
        for h in handles:
            h._wait()  # done is all that matters here: its error belongs to whoever waits on it
    if io is not None:
        io.close()  # first: requests in flight use the file
    remove_swap_dir(fd_box, file_path, dir_path)


class SwapStore:
    """``write(key, tensor)`` / ``read(key, out)`` / ``delete(key)`` against files in a private directory.

    The store creates a directory ``infinity-swap-XXXXXXXX`` (mode 0700) under
    ``directory`` and its files in it (mode 0600); :meth:`close` removes them.
    ``io`` shares an :class:`AsyncIO` between stores (it is then not closed
    here); otherwise one is made from ``backend`` .. ``thread_count``.

    A directory that does not take O_DIRECT (tmpfs, ...) raises
    :class:`DirectIOUnsupported`, unless ``buffered_fallback=True``, which
    warns and uses buffered I/O. ``stats`` (tier ``nvme``) counts the bytes of
    extents on disk as live, the payload bytes read and written, and the time
    spent in ``wait()``; its budget, if any, is enforced on write.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        io: AsyncIO | None = None,
        backend: str = "auto",
        block_size: int = 1 << 20,
        queue_depth: int = 32,
        thread_count: int = 1,
        buffered_fallback: bool = False,
        stats: TierStats | None = None,
    ) -> None:
        parent = Path(directory)
        self.stats = stats if stats is not None else TierStats("nvme")
        self._closed = True  # until fully built
        swap = create_swap_file(parent, buffered_fallback=buffered_fallback)
        self.directory = swap.directory
        self.direct = swap.direct
        self._path = swap.path
        fd_box = swap.fd_box
        try:
            self._own_io = io is None
            self.io = io if io is not None else AsyncIO(
                backend, block_size=block_size, queue_depth=queue_depth, thread_count=thread_count
            )
        except BaseException:
            _cleanup(None, fd_box, self._path, str(self.directory))
            raise
        self._fd = fd_box[0]
        self._fd_box = fd_box
        remove_dead_stores(parent, keep=self.directory)
        self._lock = threading.Lock()
        self._extents: dict[str, _Extent] = {}
        self._alloc = ExtentAllocator(ALIGNMENT)
        self._file_nbytes = 0  # what the file was grown (fallocated) to
        self._inflight: dict[str, list[tuple[IOHandle, str]]] = {}  # key -> [(handle, op)]
        self._tail_buffers: list[torch.Tensor] = []
        self._closed = False
        self._finalizer = weakref.finalize(
            self, _cleanup, self.io if self._own_io else None, fd_box, self._path, str(self.directory),
            self._inflight, self._lock,
        )
        logger.debug("swap store at %s (%s I/O, %s backend)", self.directory, "direct" if self.direct else "buffered",
                     self.io.backend)  # fmt: skip

    # -- public API ------------------------------------------------------------

    def write(self, key: str, tensor: torch.Tensor, *, urgent: bool = False) -> IOHandle:
        """Start writing ``tensor``'s bytes under ``key``. Keep ``tensor`` alive and unchanged until ``wait()``.

        ``urgent`` puts it ahead of queued writes that are not (for bytes someone will read soon).
        If the write fails, ``wait()`` raises an ``OSError`` naming the key, file, offset and errno,
        and the key is dropped (its previous contents were overwritten in part).
        """
        self._check_key(key)
        addr, nbytes = self._check_tensor(key, tensor, "write")
        self._wait_key(key, for_write=True)
        capacity = round_up(nbytes)
        with self._lock:
            self._check_open()
            ext = self._extents.get(key)
            if ext is not None and ext.capacity != capacity:
                self._drop_locked(key)
                ext = None
            if ext is None:
                ext = self._allocate_locked(key, capacity, nbytes)
                self._extents[key] = ext
            ext.nbytes = nbytes
        body = nbytes - nbytes % ALIGNMENT
        tail = nbytes - body
        bounce = None
        if nbytes == 0:
            segments = []
        elif addr % ALIGNMENT == 0:  # in place, but for the tail
            segments = [(addr, body, ext.offset)] if body else []
            if tail:
                bounce = self._take_tail_buffer()
                ctypes.memmove(bounce.data_ptr(), addr + body, tail)
                ctypes.memset(bounce.data_ptr() + tail, 0, ALIGNMENT - tail)
                segments.append((bounce.data_ptr(), ALIGNMENT, ext.offset + body))
        else:
            logger.debug("swap write %r: tensor at %#x is not %d-aligned; bouncing %d bytes", key, addr,
                         ALIGNMENT, nbytes)  # fmt: skip
            bounce = aligned_empty(capacity, torch.uint8)
            ctypes.memmove(bounce.data_ptr(), addr, nbytes)
            ctypes.memset(bounce.data_ptr() + nbytes, 0, capacity - nbytes)
            segments = [(bounce.data_ptr(), capacity, ext.offset)]

        def finalize(error: OSError | None) -> OSError | None:
            self._forget(key, handle)
            self._give_tail_buffer(bounce)
            if error is None:
                return None
            with self._lock:
                if self._extents.get(key) is ext:
                    self._drop_locked(key)
            return _name_key(error, key, "writing")

        try:
            req = self.io.submit(WRITE, self._fd, segments, path=self._path, keepalive=(tensor, bounce),
                                 stats=self.stats, count_nbytes=nbytes, urgent=urgent)  # fmt: skip
        except BaseException:
            with self._lock:
                if self._extents.get(key) is ext:
                    self._drop_locked(key)
            self._give_tail_buffer(bounce)
            raise
        handle = IOHandle([req], finalize=finalize, stats=self.stats)
        self._register(key, handle, WRITE)
        return handle

    def read(self, key: str, out: torch.Tensor, *, urgent: bool = True, at: int | None = None) -> IOHandle:
        """Start reading ``key``'s bytes into ``out`` (same number of bytes, any dtype). ``out`` is
        complete once ``wait()`` returns or ``done()`` is True; keep it alive until then. ``urgent=False``
        for a read nobody waits for yet (a read-ahead): it then queues behind urgent requests.

        ``at`` reads only part of the key: ``out``'s size in bytes from byte ``at`` of its payload, which must
        be a multiple of 4096 (a direct read starts on a block)."""
        self._check_key(key)
        addr, nbytes = self._check_tensor(key, out, "read into")
        with self._lock:
            self._check_open()
            # A read follows the key's writes in flight: held in the I/O queue until they finish,
            # without blocking the caller (who may be prefetching many keys in a row).
            after = [r for h, op in self._inflight.get(key, ()) if op == WRITE for r in h._requests]
            ext = self._extents.get(key)
            if ext is None:
                raise KeyError(f"swap key {key!r} was never written (or was deleted) in {self.directory}")
            start = self._check_range(key, ext, out, nbytes, at)
        body = nbytes - nbytes % ALIGNMENT
        tail = nbytes - body
        bounce, copy_from, copy_to, copy_n = None, 0, 0, 0  # copy_to: offset into `out`
        if nbytes == 0:
            segments = []
        elif addr % ALIGNMENT == 0:  # in place, but for the tail
            segments = [(addr, body, start)] if body else []
            if tail:  # its whole block is inside the extent: extents are whole blocks, and `at` starts one
                bounce = self._take_tail_buffer()
                segments.append((bounce.data_ptr(), ALIGNMENT, start + body))
                copy_from, copy_to, copy_n = bounce.data_ptr(), body, tail
        else:
            logger.debug("swap read %r: tensor at %#x is not %d-aligned; bouncing %d bytes", key, addr,
                         ALIGNMENT, nbytes)  # fmt: skip
            capacity = round_up(nbytes)
            bounce = aligned_empty(capacity, torch.uint8)
            segments = [(bounce.data_ptr(), capacity, start)]
            copy_from, copy_to, copy_n = bounce.data_ptr(), 0, nbytes

        def finalize(error: OSError | None) -> OSError | None:
            # Through `out` itself, so that this closure keeps it alive until the copy: the request lets
            # go of it when its I/O ends, which may be before anyone waits (out may be a temporary).
            self._forget(key, handle)
            if error is None and copy_n:
                ctypes.memmove(out.data_ptr() + copy_to, copy_from, copy_n)
            self._give_tail_buffer(bounce)
            return None if error is None else _name_key(error, key, "reading")

        try:
            req = self.io.submit(READ, self._fd, segments, path=self._path, keepalive=(out, bounce),
                                 stats=self.stats, count_nbytes=nbytes, after=after, urgent=urgent)  # fmt: skip
        except BaseException:
            self._give_tail_buffer(bounce)
            raise
        handle = IOHandle([req], finalize=finalize, stats=self.stats)
        self._register(key, handle, READ)
        return handle

    @staticmethod
    def _check_range(key: str, ext: _Extent, out: torch.Tensor, nbytes: int, at: int | None) -> int:
        """Where in the file a read of ``nbytes`` starts: the key's extent, or byte ``at`` of it."""
        if at is None:
            if ext.nbytes != nbytes:
                raise ValueError(
                    f"swap key {key!r} holds {ext.nbytes} bytes but the output tensor has {nbytes} bytes "
                    f"(shape {tuple(out.shape)}, {out.dtype})"
                )
            return ext.offset
        if at < 0 or at % ALIGNMENT or at + nbytes > ext.nbytes:
            raise ValueError(
                f"swap key {key!r} holds {ext.nbytes} bytes: cannot read {nbytes} bytes from byte {at} "
                f"(a part read starts at a multiple of {ALIGNMENT} and ends inside the key)"
            )
        return ext.offset + at

    def reserve(self, key: str, nbytes: int) -> None:
        """Allocate ``key``'s extent now, counted, without writing it, so that its first write cannot run out of
        room later. Until that write, reading it returns whatever the file held there. ``OSError`` (ENOSPC) naming
        the key and the file when the filesystem has no room for it; nothing is then reserved."""
        self._check_key(key)
        with self._lock:
            self._check_open()
            if key in self._extents:
                return
            self._extents[key] = self._allocate_locked(key, round_up(nbytes), nbytes)
            end = self._alloc.end
            if end <= self._file_nbytes:
                return
            # The preallocation failed (best effort for a write, which reports the real error): a reservation
            # is a promise of room, so it is kept only where the blocks are really there.
            try:
                os.posix_fallocate(self._fd, self._file_nbytes, end - self._file_nbytes)
                self._file_nbytes = end
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    return  # a filesystem without fallocate: the writes will find out
                self._drop_locked(key)
                raise OSError(errno.ENOSPC, f"swap store: no room to reserve {round_up(nbytes)} bytes for swap key "
                                            f"{key!r}", str(self._path)) from exc

    def delete(self, key: str) -> None:
        """Forget ``key`` and free its extent (after its requests in flight). ``KeyError`` if unknown."""
        self._check_key(key)
        self._wait_key(key, for_write=True)
        with self._lock:
            self._check_open()
            if key not in self._extents:
                raise KeyError(f"swap key {key!r} was never written (or was already deleted) in {self.directory}")
            self._drop_locked(key)

    def __contains__(self, key: object) -> bool:
        return key in self._extents

    def __len__(self) -> int:
        return len(self._extents)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._extents)

    def nbytes(self, key: str) -> int:
        """The payload bytes written under ``key``."""
        ext = self._extents.get(key)
        if ext is None:
            raise KeyError(f"swap key {key!r} was never written (or was deleted) in {self.directory}")
        return ext.nbytes

    @property
    def file_nbytes(self) -> int:
        """The size of the swap file: the end of its last extent."""
        return self._alloc.end

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, *, cancel: bool = False) -> None:
        """Wait for the requests in flight (``cancel=True``: drop their blocks not yet issued; those
        requests fail with ``ECANCELED``), then remove the store's files and directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            handles = [h for pending in self._inflight.values() for h, _ in pending] if cancel else []
        for h in handles:
            self.io.cancel(h)
        with self._lock:
            self.stats.free(sum(e.capacity for e in self._extents.values()))
            self._extents.clear()
        # waits for the requests in flight, closes our AsyncIO (if ours) and the file, removes the file and directory
        self._finalizer()
        logger.debug("swap store at %s closed", self.directory)

    def __enter__(self) -> "SwapStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._extents)} keys"
        return f"<SwapStore {self.directory} ({state}, {'direct' if self.direct else 'buffered'} I/O)>"

    # -- helpers -----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"swap store at {self.directory} is closed")

    @staticmethod
    def _check_key(key: object) -> None:
        if not isinstance(key, str):
            raise TypeError(f"swap keys are strings, got {type(key).__name__} {key!r}")

    @staticmethod
    def _check_tensor(key: str, tensor: torch.Tensor, what: str) -> tuple[int, int]:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"swap key {key!r}: can only {what} a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"swap key {key!r}: can only {what} a CPU tensor, got one on {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"swap key {key!r}: can only {what} a contiguous tensor (shape {tuple(tensor.shape)}, "
                             f"strides {tensor.stride()}); call .contiguous() first")  # fmt: skip
        return tensor.data_ptr(), tensor.numel() * tensor.element_size()

    def _allocate_locked(self, key: str, capacity: int, nbytes: int) -> _Extent:
        if capacity == 0:
            return _Extent(0, 0, nbytes)
        self.stats.allocate(capacity)  # raises MemoryError over the nvme budget, before anything changes
        offset = self._alloc.allocate(capacity)
        end = self._alloc.end
        if end > self._file_nbytes:
            # Preallocate, as fio does: O_DIRECT writes inside the file's size are asynchronous on ext4,
            # extending ones are not. Best effort: where it fails the writes report the real error.
            try:
                os.posix_fallocate(self._fd, self._file_nbytes, end - self._file_nbytes)
                self._file_nbytes = end
            except OSError as exc:
                logger.debug("swap store: preallocating %s to %d bytes failed (%s); writes will extend it",
                             self._path, end, exc)  # fmt: skip
        return _Extent(offset, capacity, nbytes)

    def _drop_locked(self, key: str) -> None:
        ext = self._extents.pop(key)
        if ext.capacity == 0:
            return
        self._alloc.free(ext.offset, ext.capacity)
        self.stats.free(ext.capacity)
        end = self._alloc.end
        if end < self._file_nbytes or os.fstat(self._fd).st_size > end:
            try:
                os.ftruncate(self._fd, end)  # give the tail of the file back to the filesystem
                self._file_nbytes = end
            except OSError as exc:
                logger.warning("swap store: could not shrink %s to %d bytes: %s", self._path, end, exc)

    def _register(self, key: str, handle: IOHandle, op: str) -> None:
        with self._lock:
            self._inflight.setdefault(key, []).append((handle, op))

    def _forget(self, key: str, handle: IOHandle) -> None:
        with self._lock:
            pending = self._inflight.get(key)
            if pending is None:
                return
            pending[:] = [(h, op) for h, op in pending if h is not handle]
            if not pending:
                del self._inflight[key]

    def _wait_key(self, key: str, *, for_write: bool) -> None:
        """Order operations on one key: a write (or delete) waits for everything in flight on it, a read
        for the writes."""
        with self._lock:
            pending = [h for h, op in self._inflight.get(key, ()) if for_write or op == WRITE]
        for h in pending:
            h._wait()

    def _take_tail_buffer(self) -> torch.Tensor:
        with self._lock:
            if self._tail_buffers:
                return self._tail_buffers.pop()
        return aligned_empty(ALIGNMENT, torch.uint8)

    def _give_tail_buffer(self, buf: torch.Tensor | None) -> None:
        if buf is not None and buf.numel() == ALIGNMENT:
            with self._lock:
                if len(self._tail_buffers) < 64:
                    self._tail_buffers.append(buf)


def _name_key(error: OSError, key: str, doing: str) -> OSError:
    """The same error with the key in its text (keeps errno, file name and offset)."""
    named = OSError(error.errno, f"{error.strerror} {doing} swap key {key!r}", error.filename)
    if hasattr(error, "offset"):
        named.offset = error.offset  # type: ignore[attr-defined]
    named.__cause__ = error
    return named
