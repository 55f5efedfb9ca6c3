"""How ``infinity train`` ends when it is told to stop: SIGTERM (what schedulers send before a kill) and SIGINT
(Ctrl-C) ask the run to stop at the next step boundary, where it saves a checkpoint when --save-dir is set,
removes its swap folder and exits 143 or 130 (128 + the signal). A run that does not reach a step boundary within
``STOP_TIMEOUT_S``, or a second signal, removes its swap files (its temporary swap folder, and its stores in a
user's --nvme-path), lets go of its --save-dir, says which folders it removed, and exits at once with the same code.
A checkpoint being written then (:meth:`GracefulStop.saving`) is not left half-written: its temporary folder is
removed, and the line says which checkpoint was not saved and which one is the latest to resume from.

Also here: :class:`Cleanup`, what a run undoes however it ends (its temporary swap folder, the process group,
the save folder's lock).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from infinity.checkpoint.publish import read_latest, remove_own_partial_save
from infinity.storage.lock_file import LockFile, LockHeld
from infinity.storage.swap_dir import remove_live_swap_dirs
from infinity.weights.export import remove_own_partial_folder

__all__ = ["Cleanup", "FOLDER_LOCK", "GracefulStop", "STOP_TIMEOUT_S"]

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = float(os.environ.get("INFINITY_STOP_TIMEOUT_S", 120))
"""Seconds between the signal and a forced exit: to finish the step and write the checkpoint."""
SIGNALS = (signal.SIGTERM, signal.SIGINT)
FOLDER_LOCK = ".infinity-lock"
"""The lock file a run holds in its temporary swap folder for its life: a later run removes the folder as soon as
nothing holds it (train_checks.remove_dead_swap_folders)."""
_MAKE_TRIES = 3


class Cleanup:
    """The temporary swap folder, the process group and the save folder's lock, undone however the run ends."""

    def __init__(self):
        self.folders: list[str] = []
        self.callbacks: list = []
        self.locks: list[LockFile] = []
        """Locks released last, also by :meth:`emergency` (the save folder's, the temporary folders')."""
        atexit.register(self.run)

    def temporary_folder(self, parent: str | None = None) -> str:
        """A private folder (0700) in ``parent`` (default the temporary directory), locked for the run's life; the pid
        in its name and the lock tell a later run whether its owner is dead (train_checks.remove_dead_swap_folders)."""
        for attempt in range(_MAKE_TRIES):
            folder = tempfile.mkdtemp(prefix=f"infinity-train-{os.getpid()}-", dir=parent)
            try:
                lock = LockFile.acquire(Path(folder) / FOLDER_LOCK)
            except (LockHeld, FileNotFoundError):  # a cleaner took it for a dead run's between mkdtemp and the lock
                shutil.rmtree(folder, ignore_errors=True)
                continue
            self.folders.append(folder)
            self.locks.append(lock)
            return folder
        raise OSError(f"cannot make a private swap folder in {parent or tempfile.gettempdir()}: another process "
                      f"removed it {_MAKE_TRIES} times in a row")

    def run(self) -> None:
        while self.callbacks:
            try:
                self.callbacks.pop()()
            except Exception as err:  # cleanup must go on; say what failed
                logger.warning("cleanup failed: %s", err)
        self.remove_folders()
        self.release_locks()

    def remove_folders(self) -> list[str]:
        """Remove the temporary folders; those removed."""
        removed = []
        while self.folders:
            folder = self.folders.pop()
            shutil.rmtree(folder, ignore_errors=True)
            if not os.path.exists(folder):
                removed.append(folder)
        return removed

    def release_locks(self) -> None:
        while self.locks:
            self.locks.pop().release()

    def emergency(self) -> list[str]:
        """For an exit that runs no finalizer (``os._exit``): remove this process' swap stores wherever they are
        (in a user's --nvme-path too) and its temporary folders, release its locks; the folders removed."""
        stores = remove_live_swap_dirs()
        folders = self.remove_folders()
        self.release_locks()
        return folders + [d for d in stores if not any(d.startswith(f + os.sep) for f in folders)]


class GracefulStop:
    """SIGTERM and SIGINT, caught for the life of a run (``with GracefulStop(cleanup) as stop:``).

    The handler only records the signal; the training loop asks :meth:`requested` at each step boundary (agreed
    over the ranks, so all stop at the same step) and ends the run itself. A timer bounds the wait.
    """

    def __init__(self, cleanup: Cleanup, timeout_s: float = STOP_TIMEOUT_S, save_dir: str | None = None):
        self.cleanup = cleanup
        self.timeout_s = timeout_s
        self.save_dir = Path(save_dir) if save_dir else None
        """--save-dir: a forced stop says which of its checkpoints is the latest."""
        self._saving: str | None = None
        """The tag of the checkpoint being written, if one is."""
        self._writing_model: Path | None = None
        """The --save-pretrained folder being written, if one is."""
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    @property
    def exit_code(self) -> int:
        """128 + the signal: 143 for SIGTERM, 130 for SIGINT."""
        return 128 + (self.signum or 0)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():  # (signals reach the main thread only)
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # a second signal: no more waiting
            self._force(f"a second {signal.Signals(signum).name}")
            return
        self.signum = signum
        writing = (f"the checkpoint {self._saving}" if self._saving is not None else
                   f"the --save-pretrained model {self._writing_model}" if self._writing_model is not None else None)
        if writing is None:
            print(f"\ninfinity train: {self.name} received: stopping at the end of this step "
                  f"(at most {self.timeout_s:.0f} s; send it again to stop now)", file=sys.stderr, flush=True)
        else:
            print(f"\ninfinity train: {self.name} received: finishing {writing} being written, then stopping (at most "
                  f"{self.timeout_s:.0f} s; send it again to stop now: what it wrote is then removed)",
                  file=sys.stderr, flush=True)
        self._timer = threading.Timer(self.timeout_s, self._force, args=(f"{self.timeout_s:.0f} s passed",))
        self._timer.daemon = True
        self._timer.start()

    @contextmanager
    def saving(self, tag: str):
        """Around the save of checkpoint ``tag`` into ``save_dir``: a forced stop meanwhile removes what it wrote."""
        self._saving = tag
        try:
            yield
        finally:
            self._saving = None

    @contextmanager
    def writing_model(self, out_dir: str):
        """Around --save-pretrained's write of ``out_dir``: a forced stop meanwhile removes the folder it was writing
        beside it (``.OUT.tmp-<pid>-*``), and says the model is not saved."""
        self._writing_model = Path(out_dir)
        try:
            yield
        finally:
            self._writing_model = None

    def _model_said(self) -> str:
        out = self._writing_model
        if out is None:
            return ""
        partial = remove_own_partial_folder(out)
        return f"the --save-pretrained model {out} was being written and is not saved{_removed_said(partial)}; "

    def _force(self, why: str) -> None:
        checkpoints = self._model_said() + self._checkpoints_said()  # (first: the save folder's lock goes below)
        removed = self.cleanup.emergency()
        said = (f"removed the swap folder{'s' if len(removed) > 1 else ''} {', '.join(removed)}" if removed else
                "no swap folder to remove")
        print(f"infinity train: {why} after {self.name}: stopping now, {checkpoints}; {said}",
              file=sys.stderr, flush=True)
        os._exit(self.exit_code)

    def _checkpoints_said(self) -> str:
        """What is saved, for the line of a forced stop; a checkpoint being written is removed, not left half-written
        (its temporary folder, and a ``latest`` being replaced: this process' own, by their pid)."""
        if self.save_dir is None:
            return "without a checkpoint (no --save-dir)"
        tag, said = self._saving, "without a new checkpoint: "
        if tag is not None:
            partial = remove_own_partial_save(self.save_dir, tag)
            if not partial and read_latest(self.save_dir) == tag:
                return f"the checkpoint {self.save_dir / tag} was saved (resume with --resume)"
            said += f"the checkpoint {tag} was being written and is not saved{_removed_said(partial)}; "
        latest = read_latest(self.save_dir)
        if latest is None:
            return said + f"{self.save_dir} holds no checkpoint"
        return said + f"the latest checkpoint is {self.save_dir / latest} (resume with --resume)"

    def requested(self, world_size: int) -> bool:
        """True on every rank when any rank was signalled (one all-reduce with several ranks)."""
        flag = self.signum is not None
        if world_size == 1:
            return flag
        import torch
        import torch.distributed as dist

        t = torch.tensor([self.signum or 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if self.signum is None and int(t) > 0:
            self.signum = int(t)
        return int(t) > 0


def _removed_said(partial: list[Path]) -> str:
    """The part of a forced stop's line naming what a write stopped part-way had written and is removed."""
    return f" (removed what it had written: {', '.join(p.name for p in partial)})" if partial else ""
