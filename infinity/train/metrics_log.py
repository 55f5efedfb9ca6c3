"""The metrics log of a training run: one CSV row per optimizer step, and TensorBoard events when installed.

``metrics.csv`` in the run folder has the columns of :data:`COLUMNS`, one row
per optimizer step, written (and flushed) as the step ends, so a run that dies
keeps every step it finished; ``infinity plot RUN_DIR`` draws it. A value not
measured at a step (validation loss between evaluations, the gradient norm of
an overlapped step) is left empty.

TensorBoard events are written too when asked (``--tensorboard DIR`` or
DeepSpeed's ``tensorboard`` block) and the ``tensorboard`` package is
installed; it is not a dependency, and a run that asks for it without it says
so at the start and goes on with the CSV alone.
"""

from __future__ import annotations

import csv
import logging
import math
import os
from pathlib import Path

from infinity.config.tier_names import TIERS

__all__ = ["COLUMNS", "METRICS_FILE", "MetricsLog", "read_metrics"]

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.csv"
COLUMNS = (
    "step", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "step_s", "exposed_io_s", "fetch_wait_s",
    *(f"{tier}_{what}" for tier in TIERS for what in ("bytes_read", "bytes_written", "peak_nbytes")),
)
"""``step`` counts optimizer steps from 1; ``exposed_io_s`` is the NVMe I/O time no compute hid (from the
engine's timeline); ``fetch_wait_s`` the time spent waiting on fetches; bytes are per step except the peaks."""


class MetricsLog:
    """Appends one row per step to ``run_dir/metrics.csv``; mirrors the numbers to TensorBoard when given a folder.

    ``resume_after``: keep the rows of an earlier run in the same folder up to that step (those after it were
    not kept by the checkpoint resumed from, and are trained again), and append after them.
    """

    def __init__(self, run_dir: str | Path, *, tensorboard_dir: str | Path | None = None, resume_after: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        kept = []
        if resume_after is not None and self.path.exists():
            kept = [row for row in read_metrics(self.path) if int(row["step"]) <= resume_after]
        tmp = self.path.with_name(f".{METRICS_FILE}.tmp-{os.getpid()}")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows({k: _cell(row.get(k)) for k in COLUMNS} for row in kept)
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._file, fieldnames=COLUMNS)
        self._tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(tensorboard_dir))

    def log(self, row: dict) -> None:
        """One step's row: keys of :data:`COLUMNS` (others refused, missing ones left empty)."""
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise ValueError(f"metrics row has unknown column(s): {', '.join(sorted(unknown))}")
        self._writer.writerow({k: _cell(row.get(k)) for k in COLUMNS})
        self._file.flush()
        if self._tb is not None:
            step = int(row["step"])
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"Train/{key}", value, step)
            self._tb.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _cell(value) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value)


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics CSV, values as floats (``None`` where empty), ``step`` as int."""
    path = Path(path)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None or "step" not in reader.fieldnames:
                raise ValueError(f"{str(path)!r} is not a metrics file: it has no 'step' column")
            rows = []
            for line, raw in enumerate(reader, start=2):
                try:
                    row = {k: (float(v) if v not in ("", None) else None) for k, v in raw.items() if k is not None}
                except ValueError as err:
                    raise ValueError(f"{str(path)!r} line {line}: {err}") from None
                row["step"] = int(row["step"])
                rows.append(row)
    except FileNotFoundError:
        raise FileNotFoundError(f"metrics file {str(path)!r} does not exist") from None
    return rows
