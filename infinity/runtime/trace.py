"""The timeline: what ran when, as a Chrome trace (opens in Perfetto), and
each step's summary: seconds of compute, of I/O, and of I/O not hidden behind
compute.

Tracks: ``compute`` (forward and backward on the main thread, less the time it
waited on fetches), ``nvme read`` and ``nvme write`` (each request from
submission to completion), ``collectives``, ``optimizer`` (each sub-group's
update), and ``waits`` (the main thread blocked on I/O).

Intervals are always kept for the current step (a handful per parameter), so
the summary costs little; events are kept for the file only when a path is set.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

TRACKS = ("compute", "nvme read", "nvme write", "collectives", "optimizer", "waits")


class Timeline:
    def __init__(self, path: str | None = None, *, rank: int = 0):
        """``path``: where :meth:`write` puts the Chrome trace at the end (``{rank}`` in it is the rank); its folder
        is checked now, so that a path that cannot be written fails before the training, not after it."""
        self.path = path
        self.rank = rank
        if path is not None:
            _check_folder_of(self.file_path, key="trace.path")
        self._t0 = time.perf_counter()
        self._events: list[dict] = []
        self._step: dict[str, list[tuple[float, float]]] = {t: [] for t in TRACKS}
        self._io: list[tuple[str, str, object]] = []  # (track, key, handle) not yet complete
        self._lock = threading.Lock()
        self._main = threading.get_ident()

    # -- recording ----------------------------------------------------------------
    def add(self, track: str, name: str, start: float, end: float, **args) -> None:
        with self._lock:
            self._step[track].append((start, end))
            if self.path is not None:
                event = {"name": name, "ph": "X", "pid": self.rank, "tid": TRACKS.index(track),
                         "ts": (start - self._t0) * 1e6, "dur": max(end - start, 0.0) * 1e6}
                if args:
                    event["args"] = args
                self._events.append(event)

    @contextlib.contextmanager
    def span(self, track: str, name: str, **args):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(track, name, start, time.perf_counter(), **args)

    def io(self, track: str, key: str, handle) -> None:
        """An NVMe request; its span is added once it has completed."""
        with self._lock:
            self._io.append((track, key, handle))

    def waited(self, start: float, end: float, what: str) -> None:
        """A wait for I/O, counted when compute was the one waiting: the main thread, or the thread autograd
        runs a GPU's backward hooks on. The engine's own workers (named ``infinity-*``) wait off the critical
        path."""
        if threading.get_ident() == self._main or not threading.current_thread().name.startswith("infinity-"):
            self.add("waits", what, start, end)

    def _collect_io(self) -> None:
        with self._lock:
            pending, self._io = self._io, []
        still = []
        for track, key, handle in pending:
            interval = handle.interval()
            if interval is None:
                still.append((track, key, handle))
            else:
                self.add(track, key, *interval, nbytes=handle.nbytes)
        with self._lock:
            self._io.extend(still)

    # -- a step's summary ----------------------------------------------------------
    def close_step(self) -> dict:
        """Seconds of compute, of I/O (and of reads, of writes, each in flight), and of I/O hidden behind nothing,
        since the last call. A request's span runs from its submission to its completion, so reads and writes
        queued together each count the time they share."""
        self._collect_io()
        with self._lock:
            step, self._step = self._step, {t: [] for t in TRACKS}
        waits = _union(step["waits"])
        compute = _subtract(_union(step["compute"]), waits)
        busy = _union(compute + step["optimizer"])
        io = _union(step["nvme read"] + step["nvme write"])
        return {"compute_s": _length(compute), "optimizer_s": _length(_union(step["optimizer"])),
                "io_s": _length(io), "io_exposed_s": _length(_subtract(io, busy)),
                "nvme_read_s": _length(_union(step["nvme read"])), "nvme_write_s": _length(_union(step["nvme write"])),
                "collectives_s": _length(_union(step["collectives"]))}

    # -- the file ------------------------------------------------------------------
    @property
    def file_path(self) -> str | None:
        """This rank's trace file."""
        if self.path is None or "{rank}" not in self.path:
            return self.path
        return self.path.format(rank=self.rank)

    def write(self) -> str | None:
        """Write the Chrome trace (atomically); returns its path."""
        if self.path is None:
            return None
        self._collect_io()
        meta = [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": i, "args": {"name": t}}
                for i, t in enumerate(TRACKS)]
        meta.append({"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}})
        with self._lock:
            events = meta + list(self._events)
        path = self.file_path
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)
        return path


class TracedStore:
    """A swap store whose requests land on the timeline; everything else passes through."""

    def __init__(self, store, timeline: Timeline):
        self._store = store
        self._timeline = timeline

    def read(self, key, out, **kwargs):
        handle = self._store.read(key, out, **kwargs)
        self._timeline.io("nvme read", key, handle)
        return _TracedHandle(handle, self._timeline, f"read {key}")

    def write(self, key, tensor, **kwargs):
        handle = self._store.write(key, tensor, **kwargs)
        self._timeline.io("nvme write", key, handle)
        return _TracedHandle(handle, self._timeline, f"write {key}")

    def __getattr__(self, name):
        return getattr(self._store, name)


class _TracedHandle:
    __slots__ = ("_handle", "_timeline", "_what")

    def __init__(self, handle, timeline: Timeline, what: str):
        self._handle = handle
        self._timeline = timeline
        self._what = what

    def wait(self, timeout=None):
        if self._handle.done():
            return self._handle.wait(timeout)
        start = time.perf_counter()
        try:
            return self._handle.wait(timeout)
        finally:
            self._timeline.waited(start, time.perf_counter(), self._what)

    def __getattr__(self, name):
        return getattr(self._handle, name)


# -- interval arithmetic -------------------------------------------------------------
def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _subtract(base: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Parts of the (disjoint, sorted) ``base`` intervals not covered by the (disjoint, sorted) ``cut``."""
    out, j = [], 0
    for start, end in base:
        cursor = start
        while j < len(cut) and cut[j][1] <= cursor:
            j += 1
        k = j
        while k < len(cut) and cut[k][0] < end:
            if cut[k][0] > cursor:
                out.append((cursor, cut[k][0]))
            cursor = max(cursor, cut[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _check_folder_of(path: str, *, key: str) -> None:
    """``path`` can be written at the end: its folder exists and is writable, and it is no folder itself; else a clear
    error naming the config ``key`` (as ``infinity train --trace`` refuses a missing folder)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        example = os.path.join(path, "trace.json")
        raise ValueError(f"{key} {path!r} is a folder: give the trace file's path (e.g. {example!r})")
    if not os.path.isdir(folder):
        raise ValueError(f"{key} {path!r}: its folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{key} {path!r}: its folder {folder!r} is not writable")
