"""Sizes in the config and on the command line: bytes (``8GiB``, ``8e9``) or a fraction of what is available
(``0.6``, ``60%``)."""

from __future__ import annotations

import math
import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_host_memory(value, key: str = "zero_optimization.host_memory_budget", *,
                      min_nbytes: int = 1 << 20) -> int | float | None:
    """A budget setting: bytes (an integer above 1, or ``"8GiB"``; at least ``min_nbytes``), or a fraction of the
    available memory (a number in (0, 1], or ``"60%"``). None stays None (the default)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{key} must be bytes (8GiB) or a fraction of the available memory (0.6, 60%), got {value!r}")
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if text.endswith("%"):
            return _fraction(key, _number(key, value, text[:-1]) / 100)
        match = re.fullmatch(r"([0-9.e+]+)([kmgt]i?b|b)?", text)
        if not match:
            raise ValueError(f"{key}: cannot read {value!r} as bytes (8GiB, 8e9) or a fraction (0.6, 60%)")
        number = _number(key, value, match.group(1))
        if match.group(2) is None and number <= 1:
            return _fraction(key, number)
        return _bytes(key, number * _UNITS[match.group(2) or ""], min_nbytes)
    if isinstance(value, (int, float)):
        return _fraction(key, float(value)) if value <= 1 else _bytes(key, value, min_nbytes)
    raise ValueError(f"{key} must be bytes or a fraction of the available memory, got {value!r}")


def parse_nbytes(value, key: str) -> int:
    """A size in bytes: a positive integer, or a number with a unit (``"5GB"``, ``"500MiB"``), as transformers'
    ``max_shard_size`` takes it."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"([0-9.e+]+)([kmgt]i?b|b)", value.strip().lower()) if isinstance(value, str) else None
    if not match:
        raise ValueError(f"{key}: cannot read {value!r} as a size in bytes (5GB, 500MiB, or an integer)")
    return max(1, int(_number(key, value, match.group(1)) * _UNITS[match.group(2)]))


def _number(key: str, raw, text: str) -> float:
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"{key}: cannot read {raw!r} as bytes (8GiB, 8e9) or a fraction (0.6, 60%)") from None
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{key} must be positive, got {raw!r}")
    return number


def _fraction(key: str, value: float) -> float:
    if not (0 < value <= 1) or not math.isfinite(value):
        raise ValueError(f"{key}: a fraction of the available memory must be in (0, 1], got {value!r}")
    return float(value)


def _bytes(key: str, value: float, min_nbytes: int = 1 << 20) -> int:
    if not math.isfinite(value) or value < min_nbytes:
        raise ValueError(f"{key}: {value!r} bytes is not a usable budget (at least {min_nbytes} bytes)")
    return int(value)
