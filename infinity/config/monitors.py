"""DeepSpeed's monitor blocks (``tensorboard``, ``csv_monitor``): whether to write each step's figures, and where
(``output_path/job_name``). Read by ``infinity train`` and by the DeepSpeed door alike."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

MONITOR_BLOCKS = ("tensorboard", "csv_monitor")
"""The DeepSpeed config's monitor blocks that are honoured (``wandb`` and ``comet`` are not)."""


@dataclass(frozen=True)
class MonitorConfig:
    """Where a monitor's files go: ``output_path/job_name`` (a DeepSpeed monitor block)."""

    enabled: bool = False
    """Write at all."""
    output_path: str = ""
    """The folder of the runs' files ("": the run's folder, or the working folder)."""
    job_name: str = "DeepSpeedJobName"
    """The sub-folder of this run's files (DeepSpeed's default name)."""


def monitor_from_deepspeed(block: Any, key: str) -> MonitorConfig:
    """DeepSpeed's ``key`` block, unknown keys refused by name."""
    if not isinstance(block, dict):
        raise ValueError(f"config key {key} must be a JSON object, got {block!r}")
    unknown = set(block) - {"enabled", "output_path", "job_name"}
    if unknown:
        raise ValueError(f"unknown config key(s) in {key}: {', '.join(sorted(map(repr, unknown)))}")
    return MonitorConfig(**block)


def tensorboard_available() -> bool:
    """The ``tensorboard`` package is installed (it is not a dependency)."""
    return importlib.util.find_spec("tensorboard") is not None
