"""``engine.tput_timer``: the samples a second of the optimizer steps so far, as DeepSpeed's ``ThroughputTimer``
reports them (scripts call ``update_epoch_count()`` at an epoch's end and read ``avg_samples_per_sec()``). A step is
timed from the forward of its first micro-batch to its ``step()``."""

from __future__ import annotations

import time


class ThroughputTimer:
    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        """Samples an optimizer step takes, over every rank."""
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self._started: float | None = None

    def start(self) -> None:
        """A micro-batch's forward begins (the step's first starts the clock)."""
        if self._started is None:
            self._started = time.perf_counter()

    def stop(self, global_step: bool = False, report_speed: bool = False) -> None:
        """A micro-batch's ``step()`` returned; ``global_step``: it was an optimizer step, which stops the clock."""
        self.micro_step_count += 1
        if global_step and self._started is not None:
            self.global_step_count += 1
            self.total_elapsed_time += time.perf_counter() - self._started
            self._started = None

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def avg_samples_per_sec(self) -> float:
        if self.total_elapsed_time <= 0:
            return 0.0
        return self.batch_size * self.global_step_count / self.total_elapsed_time
