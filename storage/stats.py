"""Accounting of one storage tier: live and peak bytes, bytes moved, time waited.

A :class:`TierStats` is shared by whatever allocates in a tier (a buffer pool
for ``host``, a swap store for ``nvme``) and is safe to update from the I/O
threads. A budget, when given, is enforced here: :meth:`TierStats.allocate`
refuses rather than overshoots.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)

__all__ = ["TierStats"]


def format_nbytes(nbytes: int | float) -> str:
    """``1536 -> '1.5 KiB'``: for error messages and tables."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.4g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _describe(live_by_owner: dict[str, int]) -> str:
    """``'optimizer staging 4 MiB, gradient slices 1.8 MiB'``: the largest first."""
    held = sorted(((n, owner) for owner, n in live_by_owner.items() if n), reverse=True)
    return ", ".join(f"{owner} {format_nbytes(n)}" for n, owner in held) or "nothing"


class TierStats:
    """Thread-safe byte and time accounting of one tier (``device``, ``host``, ``nvme``).

    ``live_nbytes`` is what is allocated now, ``peak_nbytes`` its high-water
    mark since creation or :meth:`reset_peak`; ``bytes_read`` / ``bytes_written``
    count bytes moved out of / into the tier; ``wait_s`` the seconds callers
    spent blocked on the tier's transfers.

    ``within`` is a budget this tier shares with others (the host memory that
    host buffers and, without a GPU, device buffers both take): every
    allocation is charged to it too, and refused when either budget would pass.

    Each allocation names its ``owner`` (``"gathered parameters"``, ``"optimizer staging"``, ...): live bytes are
    kept by owner too (one dict entry an allocation), so a refusal says what holds the tier.
    """

    def __init__(self, name: str, budget_nbytes: int | None = None, *, within: "TierStats | None" = None) -> None:
        if budget_nbytes is not None and budget_nbytes < 0:
            raise ValueError(f"tier {name!r}: budget_nbytes must be >= 0 or None, got {budget_nbytes}")
        self.name = name
        self.within = within
        self._budget_nbytes = budget_nbytes
        self._lock = threading.Lock()
        self._live_nbytes = 0
        self._peak_nbytes = 0
        self._bytes_read = 0
        self._bytes_written = 0
        self._wait_s = 0.0
        self._live_by_owner: dict[str, int] = {}

    # -- updates -------------------------------------------------------------

    def allocate(self, nbytes: int, owner: str = "other") -> None:
        """Count ``nbytes`` more as live, held by ``owner``; ``MemoryError`` if that would pass the budget (naming
        what is live, by owner)."""
        if nbytes < 0:
            raise ValueError(f"tier {self.name!r}: cannot allocate a negative size ({nbytes} bytes)")
        with self._lock:
            live = self._live_nbytes + nbytes
            if self._budget_nbytes is not None and live > self._budget_nbytes:
                raise MemoryError(
                    f"tier {self.name!r}: allocating {nbytes} bytes ({format_nbytes(nbytes)}) would make "
                    f"{live} bytes live, over the budget of {self._budget_nbytes} bytes "
                    f"({format_nbytes(self._budget_nbytes)}); {self._live_nbytes} bytes are live now "
                    f"({_describe(self._live_by_owner)}), and {owner} asked"
                )
            if self.within is not None:
                self.within.allocate(nbytes, owner)  # raises before this tier counts anything
            self._live_nbytes = live
            self._live_by_owner[owner] = self._live_by_owner.get(owner, 0) + nbytes
            if live > self._peak_nbytes:
                self._peak_nbytes = live

    def free(self, nbytes: int, owner: str = "other") -> None:
        """Count ``nbytes`` fewer as live (given back by ``owner``, the one that allocated them)."""
        with self._lock:
            if nbytes < 0 or nbytes > self._live_nbytes:
                raise ValueError(
                    f"tier {self.name!r}: freeing {nbytes} bytes but only {self._live_nbytes} bytes are live"
                )
            self._live_nbytes -= nbytes
            self._live_by_owner[owner] = self._live_by_owner.get(owner, 0) - nbytes
            if self.within is not None:
                self.within.free(nbytes, owner)

    def record_read(self, nbytes: int) -> None:
        with self._lock:
            self._bytes_read += nbytes

    def record_write(self, nbytes: int) -> None:
        with self._lock:
            self._bytes_written += nbytes

    def record_wait(self, seconds: float) -> None:
        with self._lock:
            self._wait_s += seconds

    def reset_peak(self) -> None:
        """Start a new high-water mark from what is live now."""
        with self._lock:
            self._peak_nbytes = self._live_nbytes

    # -- reads ---------------------------------------------------------------

    @property
    def budget_nbytes(self) -> int | None:
        return self._budget_nbytes

    def room_nbytes(self) -> int | None:
        """Bytes that can still be allocated here (and in the budget it is within); None: no limit."""
        with self._lock:
            own = None if self._budget_nbytes is None else self._budget_nbytes - self._live_nbytes
        shared = None if self.within is None else self.within.room_nbytes()
        rooms = [r for r in (own, shared) if r is not None]
        return min(rooms) if rooms else None

    def live_by_owner(self) -> dict[str, int]:
        """Live bytes by the owner that allocated them (owners holding nothing left out)."""
        with self._lock:
            return {owner: n for owner, n in self._live_by_owner.items() if n}

    @property
    def live_nbytes(self) -> int:
        return self._live_nbytes

    @property
    def peak_nbytes(self) -> int:
        return self._peak_nbytes

    @property
    def bytes_read(self) -> int:
        return self._bytes_read

    @property
    def bytes_written(self) -> int:
        return self._bytes_written

    @property
    def wait_s(self) -> float:
        return self._wait_s

    def snapshot(self) -> dict:
        """A consistent copy of every counter (the keys are the attribute names)."""
        with self._lock:
            return {
                "live_nbytes": self._live_nbytes,
                "peak_nbytes": self._peak_nbytes,
                "bytes_read": self._bytes_read,
                "bytes_written": self._bytes_written,
                "wait_s": self._wait_s,
                "budget_nbytes": self._budget_nbytes,
            }

    def __repr__(self) -> str:
        s = self.snapshot()
        budget = "none" if s["budget_nbytes"] is None else format_nbytes(s["budget_nbytes"])
        return (
            f"TierStats({self.name!r}, live={format_nbytes(s['live_nbytes'])}, peak={format_nbytes(s['peak_nbytes'])}, "
            f"budget={budget}, read={format_nbytes(s['bytes_read'])}, written={format_nbytes(s['bytes_written'])}, "
            f"wait={s['wait_s']:.3f}s)"
        )
