"""DeepSpeed's monitor under the door: each optimizer step's figures under DeepSpeed's names, at the step's global
samples, written by rank 0 where the config's ``tensorboard`` and ``csv_monitor`` blocks ask.

The figures: ``Train/Samples/train_loss`` (the mean of the step's micro-batch losses on rank 0),
``Train/Samples/lr`` (the learning rate the step used) and, in fp16, ``Train/Samples/loss_scale``. TensorBoard
events go to ``output_path/job_name`` when the ``tensorboard`` package is installed (it is not a dependency;
without it the run says so once and goes on). The CSV monitor writes one file a figure in ``output_path/job_name``,
named after it with ``/`` as ``_`` (``Train_Samples_train_loss.csv``), rows ``step,<figure>`` with the global
samples as the step, flushed as each step ends.
"""

from __future__ import annotations

import csv
import logging
import os
from pathlib import Path

from infinity.config.monitors import MonitorConfig, tensorboard_available

logger = logging.getLogger(__name__)


class DeepSpeedMonitor:
    """The run's monitors; ``write_events`` takes DeepSpeed's ``(name, value, samples)`` triples."""

    def __init__(self, blocks: dict[str, MonitorConfig], *, rank: int):
        self._tensorboard = None
        self._csv_dir: Path | None = None
        self._csv_files: dict[str, tuple] = {}  # name -> (file, writer)
        if rank != 0:
            return  # rank 0 writes, as DeepSpeed's does
        board = blocks.get("tensorboard")
        if board is not None and board.enabled:
            if tensorboard_available():
                from torch.utils.tensorboard import SummaryWriter  # needs the optional package: imported only here

                self._tensorboard = SummaryWriter(log_dir=str(_folder(board)))
            else:
                logger.warning("the config's tensorboard block is enabled but the tensorboard package is not "
                               "installed: no events are written (pip install tensorboard)")
        table = blocks.get("csv_monitor")
        if table is not None and table.enabled:
            self._csv_dir = _folder(table)
            self._csv_dir.mkdir(parents=True, exist_ok=True)

    @property
    def enabled(self) -> bool:
        return self._tensorboard is not None or self._csv_dir is not None

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, samples in events:
            if self._tensorboard is not None:
                self._tensorboard.add_scalar(name, value, samples)
            if self._csv_dir is not None:
                self._csv_writer(name).writerow([samples, value])
        if self._tensorboard is not None:
            self._tensorboard.flush()
        for file, _ in self._csv_files.values():
            file.flush()  # a run that dies keeps every step it finished

    def _csv_writer(self, name: str):
        if name not in self._csv_files:
            path = self._csv_dir / f"{name.replace('/', '_')}.csv"
            fresh = not path.exists()
            file = open(path, "a", newline="", encoding="utf-8")
            writer = csv.writer(file)
            if fresh:
                writer.writerow(["step", name.rsplit("/", 1)[-1]])
            self._csv_files[name] = (file, writer)
        return self._csv_files[name][1]

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        for file, _ in self._csv_files.values():
            file.close()
        self._csv_files.clear()


def _folder(block: MonitorConfig) -> Path:
    return Path(block.output_path or os.getcwd()) / block.job_name
