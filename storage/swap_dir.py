"""A swap store's private directory: made under a parent, its swap file opened for direct I/O (probed) or,
where asked, buffered I/O; removed when the store closes; and the leftovers of dead runs removed, never a
live run's (a store holds its file locked for its life, and the kernel drops the lock however it ends).

A directory is a dead run's the moment nothing holds its swap file's lock: a store locks its file right after
opening it and then checks that the file is still there (a cleaner holds the lock while it removes a directory,
so a store caught between its open and its lock sees its directory gone and makes another). Only a directory
without a swap file yet is judged by its age (``STALE_AFTER_S``): it may be a store being made right now.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .buffers import ALIGNMENT, aligned_empty

logger = logging.getLogger(__name__)

_TMPFS_MAGIC = 0x01021994
_RAMFS_MAGIC = 0x858458F6
_SWAP_FILE = "swap.0"
_DIR_PREFIX = "infinity-swap-"
STALE_AFTER_S = 60.0
"""A sibling swap directory without a swap file is a dead run's only when older than this (it may be a store
being made); one with a swap file is judged by its lock alone."""
_MAKE_TRIES = 3
"""Attempts at making a private directory when a cleaner removes it between the file's open and its lock."""
_live_dirs: set[str] = set()
"""This process' store directories not yet removed: what an exit that skips finalizers (``os._exit`` after a
second signal) removes with :func:`remove_live_swap_dirs`."""


class _Reclaimed(OSError):
    """The new directory was taken for a dead run's and removed between the file's open and its lock."""


class DirectIOUnsupported(OSError):
    """The swap directory does not take O_DIRECT (and the buffered fallback was not asked for)."""


def _fs_magic(path: str) -> int | None:
    """``statfs(path).f_type``, or ``None`` where it cannot be read."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.statfs(os.fsencode(path), buf) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def direct_io_problem(directory: str | os.PathLike) -> str | None:
    """Why ``directory`` does not take real direct I/O, or ``None`` if it does (filesystem check only;
    the store also probes an aligned O_DIRECT write and read)."""
    magic = _fs_magic(os.fspath(directory))
    if magic == _TMPFS_MAGIC:
        return "it is on tmpfs, which is memory: O_DIRECT there does not bypass the page cache"
    if magic == _RAMFS_MAGIC:
        return "it is on ramfs, which is memory and does not take O_DIRECT"
    return None


@dataclass
class SwapFile:
    """A store's private directory and its open swap file."""

    directory: Path
    path: str
    fd_box: list[int]
    """The file's descriptor, in a list that :func:`remove_swap_dir` empties (so it is closed once)."""
    direct: bool
    """Opened with O_DIRECT (else buffered I/O, through the page cache)."""


def create_swap_file(parent: Path, *, buffered_fallback: bool) -> SwapFile:
    """Make a private directory ``infinity-swap-XXXXXXXX`` (mode 0700) under ``parent`` and open its swap
    file (mode 0600) for direct I/O; where the filesystem does not take it, raise :class:`DirectIOUnsupported`
    or, with ``buffered_fallback``, warn and open it buffered. Nothing is left behind when it raises."""
    if not parent.exists():
        raise FileNotFoundError(errno.ENOENT, "swap directory does not exist (create it first)", str(parent))
    if not parent.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "swap path is not a directory", str(parent))
    problem = direct_io_problem(parent)
    if problem is not None and not buffered_fallback:
        raise _no_direct_io(problem, parent, "put the swap on a disk, or pass buffered_fallback=True to use "
                                             "buffered I/O there")
    for attempt in range(_MAKE_TRIES):
        try:
            return _make_private(parent, problem, buffered_fallback=buffered_fallback)
        except _Reclaimed:
            logger.debug("swap store: a cleaner removed the new directory under %s; making another", parent)
    raise OSError(errno.EAGAIN, f"cannot make a private swap directory: another process removed it {_MAKE_TRIES} "
                                f"times in a row", str(parent))


def _make_private(parent: Path, problem: str | None, *, buffered_fallback: bool) -> SwapFile:
    try:
        private = tempfile.mkdtemp(prefix=_DIR_PREFIX, dir=parent)
    except OSError as exc:
        raise type(exc)(exc.errno, f"cannot create the private swap directory: {exc.strerror}", str(parent)) from exc
    path = str(Path(private) / _SWAP_FILE)
    fd_box: list[int] = []
    try:
        os.chmod(private, 0o700)
        if problem is None:
            problem = _open_direct(path, fd_box)
            if problem is not None and not buffered_fallback:
                raise _no_direct_io(problem, parent, "pass buffered_fallback=True to use buffered I/O there")
        if problem is not None:
            warnings.warn(
                f"swap directory {parent} does not take direct I/O ({problem}); using buffered I/O "
                "(page cache) because buffered_fallback=True",
                RuntimeWarning,
                stacklevel=4,  # the code that made the SwapStore
            )
            if fd_box:
                os.close(fd_box.pop())
            fd_box.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
            _lock_new_file(fd_box[0], path)
            os.fchmod(fd_box[0], 0o600)
    except _Reclaimed:
        if fd_box:
            os.close(fd_box.pop())
        shutil.rmtree(private, ignore_errors=True)  # (gone already, or being removed by the cleaner)
        raise
    except BaseException:
        remove_swap_dir(fd_box, path, private)
        raise
    _live_dirs.add(private)
    return SwapFile(Path(private), path, fd_box, direct=problem is None)


def _lock_new_file(fd: int, path: str) -> None:
    """Lock the swap file just opened as ``fd`` for this process' life; :class:`_Reclaimed` when a cleaner got
    to it first (it holds the lock, or has removed the file meanwhile)."""
    try:
        lock_for_life(fd)
    except BlockingIOError:
        raise _Reclaimed(errno.EAGAIN, "locked by a cleaner", path) from None
    try:
        st, own = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        raise _Reclaimed(errno.ENOENT, "removed by a cleaner", path) from None
    if (st.st_dev, st.st_ino) != (own.st_dev, own.st_ino):
        raise _Reclaimed(errno.ESTALE, "replaced", path)


def _open_direct(path: str, fd_box: list) -> str | None:
    """Open the swap file with O_DIRECT and probe one aligned write and read; why not, or None."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return "the filesystem refuses O_DIRECT"
        raise
    fd_box.append(fd)
    _lock_new_file(fd, path)  # first: from here on a cleaner sees a live store
    os.fchmod(fd, 0o600)
    probe = aligned_empty(ALIGNMENT, torch.uint8)
    probe.zero_()
    view = (ctypes.c_char * ALIGNMENT).from_address(probe.data_ptr())
    try:
        os.pwritev(fd, [view], 0)
        os.preadv(fd, [view], 0)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return "an aligned O_DIRECT transfer failed with EINVAL"
        raise OSError(exc.errno, f"probing the swap file failed: {exc.strerror}", path) from exc
    finally:
        os.ftruncate(fd, 0)
    return None


def lock_for_life(fd: int) -> None:
    """Lock the swap file for as long as this process holds ``fd``."""
    # Dropped by the kernel however the process ends: a later store on the same parent can then tell a dead
    # run's leftovers from a live run's files.
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def remove_swap_dir(fd_box: list, file_path: str, dir_path: str) -> None:
    """Close the swap file (if open) and remove it and its directory."""
    _live_dirs.discard(dir_path)
    if fd_box:
        os.close(fd_box.pop())
    for remove in (lambda: os.unlink(file_path), lambda: os.rmdir(dir_path)):
        try:
            remove()
        except FileNotFoundError:
            pass
        except OSError as exc:  # e.g. someone put a file in our directory
            logger.warning("swap store: could not remove %s: %s; removing the tree", dir_path, exc)
            shutil.rmtree(dir_path, ignore_errors=True)


def remove_dead_stores(parent: str | os.PathLike, *, keep: Path | None = None) -> int:
    """Remove the swap directories under ``parent`` left by runs that died (killed, crashed): those whose
    swap file no process holds locked, at once; those without a swap file once older than ``STALE_AFTER_S``.
    Directories of live runs or of other users are left alone. Returns how many were removed."""
    removed, freed = 0, 0
    now = time.time()
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.startswith(_DIR_PREFIX) or (keep is not None and Path(entry.path) == keep):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            swap_file = os.path.join(entry.path, _SWAP_FILE)
            try:
                fd = os.open(swap_file, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:  # no file yet: a store being made, or one that died making it
                if now - entry.stat().st_mtime < STALE_AFTER_S:
                    continue
                shutil.rmtree(entry.path)
            else:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while its owner lives
                except BlockingIOError:
                    os.close(fd)
                    continue
                try:  # the lock is held while removing: a store that opened this file just now sees it go
                    nbytes = os.fstat(fd).st_size
                    shutil.rmtree(entry.path)
                finally:
                    os.close(fd)
                freed += nbytes
        except OSError as exc:  # another user's, or removed meanwhile by another run
            logger.debug("swap store: leaving %s: %s", entry.path, exc)
            continue
        removed += 1
    if removed:
        logger.warning("swap store: removed %d swap director%s (%.1f MB) left under %s by runs that died",
                       removed, "y" if removed == 1 else "ies", freed / 1e6, parent)
    return removed


def remove_live_swap_dirs() -> list[str]:
    """Remove this process' store directories now, with their files (their stores unusable from here on); the
    directories removed. For an exit that skips finalizers (``os._exit``); a normal end closes its stores."""
    removed = []
    for directory in sorted(_live_dirs):
        _live_dirs.discard(directory)
        shutil.rmtree(directory, ignore_errors=True)
        if not os.path.exists(directory):
            removed.append(directory)
    return removed


def _no_direct_io(problem: str, parent, advice: str) -> DirectIOUnsupported:
    return DirectIOUnsupported(errno.EINVAL, f"swap directory does not take direct I/O: {problem}; {advice}",
                               str(parent))
