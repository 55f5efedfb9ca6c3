"""What a Trainer run's logs say of the engine: each tier's traffic since the last log, as rates.

Every training log (the dict the Trainer prints and hands to its ``report_to`` integrations, which holds ``loss``)
gains, over the optimizer steps since the log before it:

* ``step_s``: the mean seconds of an optimizer step (from one step's end to the next, all its micro-batches);
* ``nvme_read_gb_per_s`` / ``nvme_write_gb_per_s``: the bytes this rank read from and wrote to NVMe, per second
  of those steps (where parameters or optimizer states rest on NVMe). A step's writes land behind the next
  forward, so they count in the step after;
* ``h2d_gb_per_s`` / ``d2h_gb_per_s``: the bytes that crossed between host and device memory, per second (where
  the device's memory is apart from the host's: a GPU).

The figures are this rank's (the Trainer prints the main process's).
"""

from __future__ import annotations

GB = 1e9


class OffloadLog:
    """Sums each optimizer step's :meth:`~infinity.engine.engine.Engine.step_metrics` until the next log takes them."""

    def __init__(self, *, nvme: bool, crossing: bool):
        """``nvme``: something rests on NVMe; ``crossing``: device memory is apart from host memory."""
        self._keys = (["nvme_read", "nvme_write"] if nvme else []) + (["h2d", "d2h"] if crossing else [])
        self._reset()

    def _reset(self) -> None:
        self._steps = 0
        self._seconds = 0.0
        self._nbytes = {"nvme_read": 0, "nvme_write": 0, "h2d": 0, "d2h": 0}

    def add_step(self, metrics: dict) -> None:
        """One optimizer step's metrics (``step_s``, ``tiers``, ``copies``)."""
        nvme = metrics.get("tiers", {}).get("nvme", {})
        copies = metrics.get("copies", {})
        moved = {"nvme_read": nvme.get("bytes_read", 0), "nvme_write": nvme.get("bytes_written", 0),
                 "h2d": copies.get("host_to_device_nbytes", 0), "d2h": copies.get("device_to_host_nbytes", 0)}
        for key, nbytes in moved.items():
            self._nbytes[key] += nbytes
        self._steps += 1
        self._seconds += metrics.get("step_s", 0.0)

    def take(self) -> dict[str, float]:
        """The keys for the next log (none without a step since the last), and a fresh count."""
        if not self._steps:
            return {}
        out = {"step_s": self._seconds / self._steps}
        for key in self._keys:
            out[f"{key}_gb_per_s"] = self._nbytes[key] / self._seconds / GB if self._seconds > 0 else 0.0
        self._reset()
        return out
