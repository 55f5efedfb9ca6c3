"""The machine a run is on: its CPU and GPU by name, and the compute precision it is fast in.

bf16 is fast on a CUDA device that computes it, and on a CPU with bf16 units (AMX, or AVX512-BF16): found from
the CPU's flags in ``/proc/cpuinfo``, or, where there are none to read, a ~50 ms matmul probe. On other CPUs
(AVX2 only, for example) a bf16 matmul is emulated and runs several times slower than fp32, so ``auto``
takes fp32 there.
"""

from __future__ import annotations

import functools
import logging
import platform
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CPU_MATMUL_CHOICES", "FastPrecision", "cpu_flags", "cpu_name", "fast_precision", "gpu_name",
           "machine_description", "resolve_precision", "slow_precision_warning"]

logger = logging.getLogger(__name__)

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
"""/proc/cpuinfo flags of a CPU with bf16 units."""
PRECISION_CHOICES = ("auto", "bf16", "fp32")
CPU_MATMUL_CHOICES = ("auto", "fp32", "native")
"""``cpu_matmul_precision``'s values (:mod:`infinity.runtime.cpu_matmul`); here, where the config reads them
without importing torch."""


@dataclass(frozen=True, slots=True)
class FastPrecision:
    """The precision ``auto`` takes on a device, and why."""

    precision: str
    """``bf16`` or ``fp32``."""
    reason: str
    """A few words for the start line: ``CPU has avx512_bf16``, ``CPU without bf16 units (avx2)``, ..."""


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The CPU's flags from /proc/cpuinfo, or None where there is no such file (macOS, Windows)."""
    for line in _cpuinfo().splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return None


@functools.cache
def cpu_name() -> str:
    """``AMD EPYC 7B13 (2 cores, avx2)``: the model name, the cores this process may use, the widest SIMD."""
    import os

    name = next((line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines() if line.startswith("model name")),
                platform.processor() or platform.machine() or "unknown CPU")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    flags = cpu_flags() or frozenset()
    simd = next((f for f in (*BF16_CPU_FLAGS, "avx512f", "avx2", "avx", "asimd", "neon") if f in flags), None)
    return f"{name} ({cores} cores" + (f", {simd})" if simd else ")")


@functools.cache
def last_level_cache_bytes() -> int:
    """The largest CPU cache this process's first CPU sees (its L3 on x86), from sysfs; 0 where it is not said.
    What a measurement of a memory-bound kernel must go well beyond, or it times the cache, not the memory."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    largest = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text(encoding="ascii").strip()
        except OSError:
            continue
        try:
            size = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
        except ValueError:
            continue
        largest = max(largest, size)
    return largest


def gpu_name() -> str | None:
    """The current CUDA device's name and memory, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"


def machine_description() -> str:
    """One line naming the CPU and the GPU, for benchmark outputs and RESULTS.md."""
    gpu = gpu_name()
    return f"CPU {cpu_name()}" + (f"; GPU {gpu}" if gpu else "; no GPU")


def _probe_cpu_bf16(size: int = 256, budget_s: float = 0.05) -> bool:
    """True when a bf16 matmul is at most 1.5x slower than an fp32 one on this CPU (the ~50 ms probe)."""
    import torch

    a32 = torch.randn(size, size)
    a16 = a32.to(torch.bfloat16)

    def rate(a) -> float:
        a @ a  # warm up
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < budget_s / 2:
            a @ a
            n += 1
        return n / elapsed

    return rate(a16) * 1.5 >= rate(a32)


@functools.cache
def fast_precision(device: str = "cpu") -> FastPrecision:
    """The precision the device computes fast: ``device`` is ``cpu`` or ``cuda`` (``cuda:N``)."""
    import torch

    if device.startswith("cuda"):
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return FastPrecision("bf16", f"{gpu_name()} computes bf16")
        return FastPrecision("fp32", "the GPU does not compute bf16")
    flags = cpu_flags()
    if flags is not None:
        found = [f for f in BF16_CPU_FLAGS if f in flags]
        if found:
            return FastPrecision("bf16", f"CPU has {found[0]}")
        widest = next((f for f in ("avx512f", "avx2", "avx", "asimd") if f in flags), "no SIMD flags")
        return FastPrecision("fp32", f"CPU without bf16 units ({widest})")
    if _probe_cpu_bf16():
        return FastPrecision("bf16", "a bf16 matmul probe ran as fast as fp32")
    return FastPrecision("fp32", "a bf16 matmul probe ran slower than fp32")


def default_device() -> str:
    """The device ``auto`` computes on: ``cuda`` when there is one, else ``cpu`` (as the placement decides)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_precision(requested: str, device: str | None = None) -> FastPrecision:
    """``requested`` (``auto``, ``bf16`` or ``fp32``) as a precision and the reason for it."""
    if requested not in PRECISION_CHOICES:
        raise ValueError(f"precision must be one of {', '.join(PRECISION_CHOICES)}, got {requested!r}")
    if requested != "auto":
        return FastPrecision(requested, "asked for")
    device = device if device not in (None, "auto") else default_device()
    chosen = fast_precision(device)
    logger.info("precision auto -> %s: %s", chosen.precision, chosen.reason)
    return chosen


def slow_precision_warning(precision: str, device: str, *, how_to_fix: str = 'bf16.enabled: "auto"') -> str | None:
    """The warning for computing in ``precision`` on ``device`` (``cpu``, ``cuda``) where it is emulated: bf16 on
    a CPU without bf16 units runs 20-70x slower than fp32 in torch's own kernels. The caller asks only where the
    matmuls run in torch's own kernels (``cpu_matmul_precision: "native"``, :mod:`infinity.runtime.cpu_matmul`).
    None when the precision is fast there.
    ``how_to_fix`` names the setting that picks the fast one (``bf16.enabled: "auto"``, ``--precision auto``)."""
    if precision != "bf16" or not device.startswith("cpu"):
        return None
    fast = fast_precision("cpu")
    if fast.precision == "bf16":
        return None
    return (f"bf16 is asked for but the CPU {cpu_name()} has no bf16 units ({fast.reason}) and cpu_matmul_precision is "
            f"\"native\": torch's bf16 matmul is a scalar fallback there, 20-70x slower than fp32; leave "
            f"cpu_matmul_precision at \"auto\" (matmuls in fp32, rounded), or set {how_to_fix} to compute in the "
            f"fast precision (fp32 here)")
