"""One live run owns a save folder at a time.

Two runs saving into one folder replace each other's checkpoints step by step, and both end well. So the first
save into a folder (rank 0 of :func:`~infinity.checkpoint.save.save_checkpoint`; ``infinity train --save-dir``
before any work) takes a lock file in it, ``.infinity-lock``, holding the owner's pid and host, for the rest of
the process' life or until :func:`release_save_dir`; another process asking for it is refused with
:class:`SaveDirInUse` naming the owner, or waits (``wait=True``). The kernel drops the lock however the owner
ends, so a killed run never blocks the next one; the file is removed when the lock is released.
"""

from __future__ import annotations

import atexit
import logging
import os
from pathlib import Path
from typing import Callable

from infinity.storage.lock_file import LockFile, LockHeld

logger = logging.getLogger(__name__)

__all__ = ["LOCK_FILE", "SaveDirInUse", "hold_save_dir", "holds_save_dir", "release_save_dir"]

LOCK_FILE = ".infinity-lock"
"""The lock file in a save folder (a dot name: never taken for a checkpoint)."""

_held: dict[str, LockFile] = {}
"""The save folders this process holds, by real path."""


class SaveDirInUse(OSError):
    """Another live process holds the save folder; ``holder`` says which (``pid N on host H``)."""

    def __init__(self, save_dir: str, holder: str):
        super().__init__(
            f"save folder {save_dir!r} is in use by another live run ({holder}): two runs saving into one folder "
            f"replace each other's checkpoints. Wait for it to end (infinity train --wait-for-lock), or save "
            f"somewhere else")
        self.save_dir = save_dir
        self.holder = holder


def _key(save_dir) -> str:
    return os.path.realpath(save_dir)


def holds_save_dir(save_dir) -> bool:
    """True when this process holds ``save_dir``."""
    lock = _held.get(_key(save_dir))
    return lock is not None and lock.held


def hold_save_dir(save_dir, *, wait: bool = False, on_wait: Callable[[str], None] | None = None) -> LockFile:
    """Take ``save_dir`` (made, with its parents, if missing) for this process; a no-op when it holds it already.
    Held by another live process: :class:`SaveDirInUse`, or with ``wait`` block until it is free
    (``on_wait(holder)`` first). The returned lock's ``waited`` says whether it waited."""
    key = _key(save_dir)
    lock = _held.get(key)
    if lock is not None and lock.held:
        return lock
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    try:
        lock = LockFile.acquire(Path(key) / LOCK_FILE, wait=wait, on_wait=on_wait)
    except LockHeld as err:
        raise SaveDirInUse(str(save_dir), err.holder) from None
    _held[key] = lock
    logger.info("save folder %s taken for this run (%s)", save_dir, LOCK_FILE)
    return lock


@atexit.register
def _release_all() -> None:
    """At a normal exit, the lock files of folders still held go too (the kernel drops the locks anyway)."""
    for key in list(_held):
        release_save_dir(key)


def release_save_dir(save_dir) -> None:
    """Let go of ``save_dir`` (its lock file removed); a no-op when this process does not hold it."""
    lock = _held.pop(_key(save_dir), None)
    if lock is not None:
        lock.release()
