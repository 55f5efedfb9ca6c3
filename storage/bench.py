"""Bandwidth of the tiers: what ``infinity bench`` and ``benchmarks/bench_storage.py`` measure.

NVMe: one file of ``nbytes`` written, then read, with O_DIRECT through
:class:`~.aio.AsyncIO` at a given block size, queue depth and backend, like
``fio --rw=write|read --direct=1 --ioengine=libaio``: the file is preallocated
before the timed write (fio lays files out the same way) and removed after.
Reads bypass the page cache (O_DIRECT). GB/s are decimal (1e9 bytes/s), as
fio's ``bw_bytes``. :func:`measure_nvme_sustained` does the same over a set of
files far larger than one burst (a virtual disk slows down after one), and
adds a pass that reads half the set while it rewrites the other half through
the same queue, as a training step's swap traffic does.

Host⇄device: copies between a pinned aligned host buffer and a CUDA tensor.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
import shutil
import statistics
import tempfile
import time

import torch

from .aio import AsyncIO
from .buffers import ALIGNMENT, aligned_empty
from .stats import format_nbytes
from .swap_store import direct_io_problem

logger = logging.getLogger(__name__)

__all__ = [
    "NvmeResult",
    "BenchBuffers",
    "measure_nvme",
    "SustainedResult",
    "measure_nvme_sustained",
    "measure_copy",
    "parse_size",
    "check_free_space",
    "median",
]

_MAX_BUFFER_NBYTES = 256 << 20
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """``'1GiB'``, ``'512MiB'``, ``'1G'``, ``'64k'``, ``'4096'`` -> bytes. Suffixes are binary
    (K, M, G, T with or without ``iB`` / ``B``), as in fio."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", str(text), re.IGNORECASE)
    if m is None or (m.group(3) and not m.group(2) and m.group(3).lower() == "ib"):
        raise ValueError(f"cannot read size {text!r}: use bytes or a number with K, M, G, T (e.g. 1GiB, 512MiB, 4096)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value != int(value):
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def median(values: list[float]) -> float:
    return statistics.median(values)


def check_free_space(directory: str | os.PathLike, nbytes: int) -> None:
    """``OSError(ENOSPC)`` naming the path unless ``nbytes`` (plus 1%) fit on its filesystem."""
    free = shutil.disk_usage(directory).free
    need = nbytes + nbytes // 100
    if free < need:
        raise OSError(
            errno.ENOSPC,
            f"not enough free space for the benchmark file: need {format_nbytes(need)}, "
            f"{format_nbytes(free)} free",
            str(directory),
        )


class _Bandwidths:
    """The rates of a result that moved ``nbytes`` each way, written in ``write_s`` and read in ``read_s``."""

    __slots__ = ()
    nbytes: int
    write_s: float
    read_s: float

    @property
    def write_GBps(self) -> float:  # noqa: N802 (the unit's spelling)
        return self.nbytes / self.write_s / 1e9

    @property
    def read_GBps(self) -> float:  # noqa: N802
        return self.nbytes / self.read_s / 1e9


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NvmeResult(_Bandwidths):
    """One write pass and one read pass of a file."""

    backend: str
    """What ran: ``libaio`` or ``threads`` (``auto`` resolved)."""
    nbytes: int
    block_size: int
    queue_depth: int
    thread_count: int
    write_s: float
    read_s: float
    rewrite: bool = False
    """The timed write overwrote blocks written before (see :func:`measure_nvme`)."""



class BenchBuffers:
    """Aligned source and destination buffers, filled once and reused across measurements
    (page-faulting a fresh GiB per point would be measured otherwise). ``huge_pages=False``:
    ordinary 4 KiB pages, as fio's buffers."""

    def __init__(self, *, huge_pages: bool = True) -> None:
        self.huge_pages = huge_pages
        self._src: torch.Tensor | None = None
        self._dst: torch.Tensor | None = None

    def get(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        size = min(nbytes, _MAX_BUFFER_NBYTES)
        if self._src is None or self._src.numel() < size:
            self._src = aligned_empty(size, torch.uint8, huge_pages=self.huge_pages)
            self._src.view(torch.int32)[: size // 4].random_()  # incompressible, every page touched
            self._dst = aligned_empty(size, torch.uint8, huge_pages=self.huge_pages)
            self._dst.fill_(0)
        return self._src, self._dst


def measure_nvme(
    directory: str | os.PathLike,
    *,
    nbytes: int,
    block_size: int = 1 << 20,
    queue_depth: int = 32,
    backend: str = "auto",
    thread_count: int = 1,
    single_submit: bool = False,
    overlap_events: bool = True,
    buffers: BenchBuffers | None = None,
    verify: bool = True,
    rewrite: bool = False,
) -> NvmeResult:
    """Time writing then reading a fresh ``nbytes`` file in ``directory`` with O_DIRECT.

    ``rewrite``: the file is written once before the timed write, which then overwrites blocks that hold data,
    as a swap store's writes do once each key has its extent (a training step's steady write-back). A first
    write into preallocated blocks can be much slower (a virtual disk, ext4's unwritten extents); without
    ``rewrite`` that first write is the one timed."""
    if nbytes <= 0 or nbytes % ALIGNMENT:
        raise ValueError(f"benchmark size must be a positive multiple of {ALIGNMENT} bytes, got {nbytes}")
    if block_size <= 0 or block_size % ALIGNMENT:
        raise ValueError(f"block size must be a positive multiple of {ALIGNMENT} bytes, got {block_size}")
    problem = direct_io_problem(directory)
    if problem is not None:
        raise OSError(errno.EINVAL, f"cannot benchmark direct I/O here: {problem}", str(directory))
    src, dst = (buffers or BenchBuffers()).get(nbytes)
    chunk = src.numel()
    fd, path = tempfile.mkstemp(prefix="infinity-bench-", suffix=".dat", dir=directory)
    os.close(fd)
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        os.unlink(path)
        if exc.errno == errno.EINVAL:
            raise OSError(exc.errno, "the filesystem refuses O_DIRECT", path) from exc
        raise
    try:
        os.posix_fallocate(fd, 0, nbytes)  # laid out before the clock starts, as fio does
        with AsyncIO(backend, block_size=block_size, queue_depth=queue_depth, thread_count=thread_count,
                     single_submit=single_submit, overlap_events=overlap_events) as io:  # fmt: skip
            offsets = range(0, nbytes, chunk)
            if rewrite:  # laid out with data, untimed: the timed pass overwrites it
                for h in [io.pwrite(fd, src[: min(chunk, nbytes - off)], off) for off in offsets]:
                    h.wait()
            start = time.perf_counter()
            handles = [io.pwrite(fd, src[: min(chunk, nbytes - off)], off) for off in offsets]
            for h in handles:
                h.wait()
            write_s = time.perf_counter() - start
            start = time.perf_counter()
            handles = [io.pread(fd, dst[: min(chunk, nbytes - off)], off) for off in offsets]
            for h in handles:
                h.wait()
            read_s = time.perf_counter() - start
            if verify:  # the last chunk read landed in dst; it must be what was written there
                last = offsets[-1]
                n = min(chunk, nbytes - last)
                io.pread(fd, dst[:n], last).wait()
                if not torch.equal(dst[:n], src[:n]):
                    raise OSError(errno.EIO, f"read back differs from what was written (at offset {last})", path)
            used = io.backend
    finally:
        os.close(fd)
        os.unlink(path)
    return NvmeResult(backend=used, nbytes=nbytes, block_size=block_size, queue_depth=queue_depth,
                      thread_count=thread_count, write_s=write_s, read_s=read_s, rewrite=rewrite)  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SustainedResult(_Bandwidths):
    """A write pass, a read pass and a mixed pass over one set of files."""

    backend: str
    nbytes: int
    """Bytes of the file set; each pass moves all of them (the mixed one reads half and writes half)."""
    file_count: int
    block_size: int
    queue_depth: int
    write_s: float
    read_s: float
    mixed_s: float


    @property
    def mixed_GBps(self) -> float:  # noqa: N802
        """Bytes read plus bytes written a second, reads and writes in flight together."""
        return self.nbytes / self.mixed_s / 1e9

    def floor_s(self, bytes_read: int, bytes_written: int) -> float:
        """Seconds this disk needs to read and then write these bytes at the passes' rates."""
        return bytes_read / (self.read_GBps * 1e9) + bytes_written / (self.write_GBps * 1e9)

    def mixed_floor_s(self, bytes_read: int, bytes_written: int) -> float:
        """Seconds at the mixed pass's rate (reads and writes overlapped)."""
        return (bytes_read + bytes_written) / (self.mixed_GBps * 1e9)


def measure_nvme_sustained(
    directory: str | os.PathLike,
    *,
    nbytes: int,
    file_nbytes: int = 1 << 30,
    block_size: int = 1 << 20,
    queue_depth: int = 32,
    backend: str = "auto",
    thread_count: int = 1,
    buffers: BenchBuffers | None = None,
) -> SustainedResult:
    """Time writing a set of ``nbytes`` in files of ``file_nbytes`` with O_DIRECT, reading it back, then reading
    its first half while its second half is rewritten (both queued on one :class:`AsyncIO`, as the engine's
    swap store queues a step's reads and writes). The last chunk read is checked against what was written.
    The files are removed after, also on failure."""
    if file_nbytes <= 0 or file_nbytes % ALIGNMENT:
        raise ValueError(f"file size must be a positive multiple of {ALIGNMENT} bytes, got {file_nbytes}")
    if nbytes < 2 * file_nbytes or nbytes % file_nbytes:
        raise ValueError(f"the file set ({nbytes} bytes) must be at least two files of {file_nbytes} bytes, and a "
                         f"whole number of them")
    problem = direct_io_problem(directory)
    if problem is not None:
        raise OSError(errno.EINVAL, f"cannot benchmark direct I/O here: {problem}", str(directory))
    src, dst = (buffers or BenchBuffers()).get(file_nbytes)
    chunk = src.numel()
    count = nbytes // file_nbytes
    paths: list[str] = []
    fds: list[int] = []
    try:
        for _ in range(count):
            fd, path = tempfile.mkstemp(prefix="infinity-bench-", suffix=".dat", dir=directory)
            os.close(fd)
            paths.append(path)
            fds.append(os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC))
            os.posix_fallocate(fds[-1], 0, file_nbytes)  # laid out before the clock starts, as fio does
        offsets = range(0, file_nbytes, chunk)

        def submit_all(method, files, buffer):
            return [method(fd, buffer[: min(chunk, file_nbytes - off)], off) for fd in files for off in offsets]

        def timed(*batches) -> float:
            start = time.perf_counter()
            for handles in batches:
                for h in handles:
                    h.wait()
            return time.perf_counter() - start

        with AsyncIO(backend, block_size=block_size, queue_depth=queue_depth, thread_count=thread_count) as io:
            write_s = timed(submit_all(io.pwrite, fds, src))
            read_s = timed(submit_all(io.pread, fds, dst))
            half = count // 2
            start = time.perf_counter()
            reads, writes = [], []
            for fd_read, fd_write in zip(fds[:half], fds[half:2 * half]):  # interleaved, as a step's traffic
                reads += submit_all(io.pread, [fd_read], dst)
                writes += submit_all(io.pwrite, [fd_write], src)
            timed(reads, writes)
            mixed_s = (time.perf_counter() - start) * count / (2 * half)  # (an odd count: scaled to the set)
            last = offsets[-1]
            n = min(chunk, file_nbytes - last)
            io.pread(fds[-1], dst[:n], last).wait()
            if not torch.equal(dst[:n], src[:n]):
                raise OSError(errno.EIO, f"read back differs from what was written (at offset {last})", paths[-1])
            used = io.backend
    finally:
        for fd in fds:
            os.close(fd)
        for path in paths:
            os.unlink(path)
    return SustainedResult(backend=used, nbytes=nbytes, file_count=count, block_size=block_size,
                           queue_depth=queue_depth, write_s=write_s, read_s=read_s, mixed_s=mixed_s)


def measure_copy(nbytes: int, *, repeat: int = 3) -> dict[str, float] | None:
    """Host⇄device copy GB/s between a pinned aligned host buffer and CUDA memory; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    host = aligned_empty(nbytes, torch.uint8, pin=True)
    host.fill_(1)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out: dict[str, list[float]] = {"h2d_GBps": [], "d2h_GBps": []}
    for _ in range(repeat):
        for name, dst, src in (("h2d_GBps", device, host), ("d2h_GBps", host, device)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            out[name].append(nbytes / (time.perf_counter() - start) / 1e9)
    return {k: median(v) for k, v in out.items()}
