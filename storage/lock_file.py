"""A lock file that says which live process owns a folder: held for the owner's life, released at its exit or
death (the kernel drops an ``flock`` however a process ends), so a dead owner never blocks the next one.

The file holds the owner's ``pid host`` (what a refused process is told). It is removed on release, which is safe
because every acquirer checks, once it holds the lock, that the path still names the file it locked (else the
file was released and removed meanwhile, and it tries again on the new one)::

    lock = LockFile.acquire(folder / ".infinity-lock")          # LockHeld (an OSError) naming the holder
    lock = LockFile.acquire(path, wait=True, on_wait=print)     # or wait for the holder to end
    ...
    lock.release()
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger(__name__)

__all__ = ["LockFile", "LockHeld", "holder_of", "is_held", "remove_if_unheld"]


class LockHeld(OSError):
    """The lock is held by another live process; ``holder`` says which (``pid N on host H``)."""

    def __init__(self, path: str, holder: str):
        super().__init__(errno.EWOULDBLOCK, f"locked by {holder}", path)
        self.holder = holder


def _this_process() -> str:
    return f"{os.getpid()} {socket.gethostname()}"


def _describe(text: str) -> str:
    """``pid 123 on host h`` from the file's ``123 h``; what is known when the holder has not written it yet."""
    parts = text.split()
    if len(parts) >= 2 and parts[0].isdigit():
        return f"pid {parts[0]} on host {parts[1]}"
    return "another process (it has not written its pid yet)"


def holder_of(path: str | os.PathLike) -> str:
    """Who the file says holds the lock (``pid N on host H``); read only, nothing is locked."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return _describe(f.read(200))
    except OSError:
        return "another process"


def is_held(path: str | os.PathLike) -> bool:
    """True while a live process holds the lock at ``path``; False when the file is missing or nobody holds it.
    (Testing takes the lock for an instant, so a process calling ``acquire`` at that instant is told to retry.)"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (also drops the lock taken just now)
    return False


def remove_if_unheld(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """Remove ``folder`` (which holds the lock file ``path``) when no process holds the lock: its owner is dead.
    The lock is held while removing, so an owner caught between opening the file and locking it sees it go.
    True when removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        shutil.rmtree(folder)
        return True
    finally:
        os.close(fd)


@dataclass
class LockFile:
    """A held lock on ``path``; :meth:`release` removes the file and drops the lock (idempotent)."""

    path: str
    fd: int
    waited: bool = False
    """The lock was held by another process when asked for, and this one waited for it (``wait=True``)."""

    @classmethod
    def acquire(cls, path: str | os.PathLike, *, wait: bool = False,
                on_wait: Callable[[str], None] | None = None) -> "LockFile":
        """Take the lock at ``path`` (the file is made, mode 0600, in an existing folder) and write this process'
        ``pid host`` in it. Held by another process: :class:`LockHeld` naming it, or with ``wait``, block until it
        is released (``on_wait(holder)`` is called once before waiting)."""
        path = os.fspath(path)
        waited = False
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                if not _try_lock(fd):
                    holder = holder_of(path)
                    if not wait:
                        raise LockHeld(path, holder) from None
                    if not waited and on_wait is not None:
                        on_wait(holder)
                    waited = True
                    fcntl.flock(fd, fcntl.LOCK_EX)  # blocks until the holder releases it or dies
                if not _still_names(path, fd):  # released and removed while we waited: take the new file's
                    os.close(fd)
                    continue
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{_this_process()}\n".encode(), 0)
            except BaseException:
                _close_quietly(fd)
                raise
            logger.debug("lock %s taken", path)
            return cls(path, fd, waited=waited)

    def release(self) -> None:
        """Remove the file, then drop the lock: a process waiting on it sees that the file is gone and retries."""
        if self.fd < 0:
            return
        try:
            if _still_names(self.path, self.fd):
                os.unlink(self.path)
        except OSError as err:  # the folder went away, or became read-only: the lock drops all the same
            logger.debug("lock %s: could not remove it: %s", self.path, err)
        fd, self.fd = self.fd, -1
        _close_quietly(fd)
        logger.debug("lock %s released", self.path)

    @property
    def held(self) -> bool:
        return self.fd >= 0


def _still_names(path: str, fd: int) -> bool:
    """True when ``path`` is the file open as ``fd`` (not removed nor replaced since it was opened)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _try_lock(fd: int, tries: int = 5) -> bool:
    """Take the lock without blocking; a few tries apart, as :func:`is_held` holds it for an instant to test it."""
    for i in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if i + 1 < tries:
                time.sleep(0.01)
    return False


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
