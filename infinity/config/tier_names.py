"""The tier vocabulary, defined once: the three tiers a state rests in, and the config's offload-device names
(``zero_optimization.offload_*.device``) that choose them.

Both are string enums: a member *is* its string (``Tier.NVME == "nvme"``, ``f"{Tier.HOST}" == "host"``), so JSON
output, metrics columns, dict keys and log lines spell them as before. The plain tuples below (``TIERS``,
``OFFLOAD_DEVICES``) are what command-line choices and error messages list.

This module imports nothing: the config, the estimate, the metrics log and the commands all read it.
"""

from __future__ import annotations

import enum
import sys

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # Python 3.10: a str mixin whose str() and format() are the value, as 3.11's StrEnum
    class StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return self.value

        def __format__(self, spec: str) -> str:
            return self.value.__format__(spec)

__all__ = ["OFFLOAD_DEVICES", "OPTIMIZER_OFFLOAD_DEVICES", "TIERS", "TIER_OF_OFFLOAD", "OffloadDevice", "Tier"]


class Tier(StrEnum):
    """Where bytes rest."""

    DEVICE = "device"
    """The compute device's memory (the host's own on a machine without a GPU)."""
    HOST = "host"
    """Host (CPU) memory."""
    NVME = "nvme"
    """Swap files on a disk, read and written with direct I/O."""


class OffloadDevice(StrEnum):
    """A config's ``offload_param.device`` / ``offload_optimizer.device``: DeepSpeed's names for the tiers."""

    NONE = "none"
    """Not offloaded: the state rests on the device."""
    CPU = "cpu"
    """Host memory."""
    NVME = "nvme"
    """NVMe swap files under ``nvme_path``."""
    AUTO = "auto"
    """Optimizer states only (our value): the sub-groups that fit the device-memory budget on the device, the
    rest in host memory, and with an ``nvme_path`` what the host budget cannot hold on NVMe. No single tier."""

    @property
    def tier(self) -> Tier:
        """The tier this offload device puts a state in (``auto`` has none: ask the optimizer's config)."""
        if self is OffloadDevice.AUTO:
            raise ValueError("offload device 'auto' puts sub-groups in several tiers; it has no single tier")
        return TIER_OF_OFFLOAD[self]


TIERS: tuple[str, ...] = tuple(t.value for t in Tier)
"""``("device", "host", "nvme")``, in that order (nearest the compute first): columns, tables, summaries."""
OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu", "nvme")
"""The choices of ``offload_param.device`` and ``--offload-param``: one tier each."""
OPTIMIZER_OFFLOAD_DEVICES: tuple[str, ...] = OFFLOAD_DEVICES + ("auto",)
"""The choices of ``offload_optimizer.device`` and ``--offload-optimizer``: a tier, or ``auto`` (split per sub-group)."""
TIER_OF_OFFLOAD: dict[str, Tier] = {OffloadDevice.NONE: Tier.DEVICE, OffloadDevice.CPU: Tier.HOST,
                                    OffloadDevice.NVME: Tier.NVME}
"""An offload device (member or its string) -> the tier the state rests in."""
