"""Builds, caches and loads the C++ kernels (``csrc/adam.cpp``, ``csrc/adam_compact.cpp``, ``csrc/sq_norm.cpp``).

The kernel is built on first use with torch's cpp_extension (ninja), once per
machine: the build directory is
``$XDG_CACHE_HOME/zero-infinity/kernels/<key>`` (``~/.cache/...`` by default),
where the key hashes everything the binary depends on: the sources, the
compiler, the CPU's feature flags (the build uses ``-march=native``), the
torch build and the Python ABI. A later process with the same key loads the
cached library without invoking the build.

Loading happens once per process, under a lock. When no compiler is found or
the build fails, a warning is logged once and ``ops()`` returns None; callers
then use the torch reference.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import torch

from .constants import AdamConstants

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().with_name("csrc")
_SOURCES = ("adam.cpp", "adam_compact.cpp", "sq_norm.cpp")
_NAME = "infinity_kernels_adam"
_MARKER = "built.ok"
_STALE_LOCK_SECONDS = 15 * 60  # a build takes well under a minute
BUILD_MESSAGE = "infinity.kernels: building the fused Adam kernel (once per machine, ~30 s)..."

# Code paths in csrc/adam.cpp; "auto" is the best one this CPU runs.
ISA_CODES = {"auto": 0, "generic": 1, "avx2": 2, "avx512": 3}


def compile_flags() -> list[str]:
    """Flags for the kernel's build (they are part of the cache key)."""
    flags = [
        "-O3",
        "-fopenmp",  # at::parallel_for's OpenMP region is compiled into the caller
        "-ffp-contract=off",  # no FMA contraction: the reference's numerics are exact
        "-fno-math-errno",  # lets sqrtf vectorize in the generic body
        # lets the compiler compute both sides of a float select without a branch
        # (csrc/adam_compact.cpp's loops vectorize only then); values are unchanged
        "-fno-trapping-math",
    ]
    if platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64"):
        flags.append("-march=native")
    return flags


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zero-infinity" / "kernels"


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _cpu_flags() -> str:
    """The CPU's feature flags as the kernel's build sees them (cpuinfo on Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return " ".join(sorted(value.split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def cache_key() -> str:
    """A hash of everything the built library depends on."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(_CSRC)):
        if name.endswith((".cpp", ".h")):
            h.update(name.encode())
            h.update((_CSRC / name).read_bytes())
    cxx = _compiler()
    try:
        version = subprocess.run(
            [cxx, "--version"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        version = f"unavailable: {exc}"
    parts = [
        f"compiler={shutil.which(cxx)} {version}",
        f"cpu={platform.machine()} {_cpu_flags()}",
        f"torch={torch.__version__} {torch.version.git_version}",
        f"python={sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')}",
        f"flags={' '.join(compile_flags())}",
    ]
    for part in parts:
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:20]


class _Kernel:
    """The loaded library's ops, loaded (and if need be built) once per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded = False
        self._ops = None
        self._error: str | None = None
        self.build_seconds: float | None = None

    def ops(self):
        """The ops namespace, or None when the kernel cannot be built or loaded."""
        if not self._loaded:  # double-checked: the lock is taken only until loaded
            with self._lock:
                if not self._loaded:
                    self._ops, self._error = self._load()
                    self._loaded = True
        return self._ops

    @property
    def error(self) -> str | None:
        """Why the kernel is unavailable, once ``ops()`` has returned None."""
        return self._error

    def _load(self):
        cxx = _compiler()
        if shutil.which(cxx) is None:
            return self._unavailable(f"no C++ compiler: {cxx!r} is not on PATH (set CXX)")
        try:
            build_dir = cache_root() / cache_key()
            library = build_dir / f"{_NAME}.so"
            if (build_dir / _MARKER).is_file() and library.is_file():
                torch.ops.load_library(str(library))
            else:
                self._build(build_dir)
            return torch.ops.infinity_kernels, None
        except Exception as exc:  # a failed build may raise anything; we fall back
            return self._unavailable(f"{type(exc).__name__}: {_first_lines(str(exc))}")

    def _build(self, build_dir: Path) -> None:
        from torch.utils import cpp_extension  # imported only to build

        build_dir.mkdir(parents=True, exist_ok=True)
        # cpp_extension waits for as long as its lock file exists; one left by
        # a build that was killed would make every later process wait forever.
        lock = build_dir / "lock"
        try:
            if time.time() - lock.stat().st_mtime > _STALE_LOCK_SECONDS:
                logger.warning("infinity.kernels: removing a stale build lock %s", lock)
                lock.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        print(BUILD_MESSAGE, file=sys.stderr, flush=True)
        start = time.perf_counter()
        # cpp_extension holds a lock file in build_dir, so concurrent processes
        # build once; it loads the library into this process when done.
        cpp_extension.load(
            name=_NAME,
            sources=[str(_CSRC / s) for s in _SOURCES],
            extra_cflags=compile_flags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
        self.build_seconds = time.perf_counter() - start
        # Written last and atomically: later processes trust a build only with it.
        tmp = build_dir / f"{_MARKER}.{os.getpid()}"
        tmp.write_text(f"built in {self.build_seconds:.1f} s\n")
        os.replace(tmp, build_dir / _MARKER)
        logger.info("built %s in %.1f s", build_dir, self.build_seconds)

    def _unavailable(self, why: str):
        logger.warning(
            "infinity.kernels: the C++ Adam kernel is unavailable (%s); "
            "using the torch reference, which is slower",
            why,
        )
        return None, why


def _first_lines(text: str, limit: int = 600) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + " …"


KERNEL = _Kernel()


def adam_update(
    constants: AdamConstants,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: torch.Tensor | None,
    *,
    isa: str = "auto",
    threads: int = 0,
    grad_sq_norm: torch.Tensor | None = None,
) -> None:
    """Applies one step in place with the C++ kernel (which must be loaded), on ``threads`` threads (0: torch's
    count; ``csrc/chunks.h``). ``grad_sq_norm``, a one-element fp64 tensor, receives the gradient's squared norm,
    taken in the same pass (``csrc/sq_norm.h``: the bits of ``sq_norm_fp64``)."""
    c = constants
    KERNEL.ops().adam_step(
        param, grad, exp_avg, exp_avg_sq, param_out,
        c.decoupled, c.decay, c.l2, c.lerp_weight, c.beta2, c.beta2_complement,
        c.bias_correction2_sqrt, c.neg_step_size, c.eps, ISA_CODES[isa], threads, grad_sq_norm,
    )  # fmt: skip


def touch(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: torch.Tensor | None = None,
    *,
    isa: str = "auto",
) -> None:
    """The bandwidth floor for benchmarks: the step's loads and stores, no Adam arithmetic.

    Each element of param, exp_avg and exp_avg_sq becomes itself plus 0 × grad
    (unchanged for finite grads); ``param_out`` receives param.
    """
    KERNEL.ops().touch(param, grad, exp_avg, exp_avg_sq, param_out, ISA_CODES[isa])


def best_isa() -> str:
    """The kernel body this CPU runs: "avx512", "avx2" or "generic"."""
    return KERNEL.ops().best_isa()


def adam_update_compact(
    constants: AdamConstants,
    state_dtype: str,
    keys: tuple[int, int],
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_scale: torch.Tensor | None,
    exp_avg_sq_scale: torch.Tensor | None,
    param_out: torch.Tensor | None,
    *,
    isa: str = "auto",
    threads: int = 0,
    grad_sq_norm: torch.Tensor | None = None,
) -> None:
    """Applies one step in place on compact states ("bf16" or "int8") with the C++ kernel.

    Its bodies are "generic", "avx2" and "avx512" ("auto": the best this CPU runs); ``threads`` and
    ``grad_sq_norm`` as for :func:`adam_update`.
    """
    c = constants
    KERNEL.ops().adam_step_compact(
        master, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param_out,
        state_dtype == "int8", c.decoupled, c.decay, c.l2, c.lerp_weight, c.beta2, c.beta2_complement,
        c.bias_correction2_sqrt, c.neg_step_size, c.eps, keys[0], keys[1], ISA_CODES[isa], threads, grad_sq_norm,
    )  # fmt: skip


def touch_compact(
    state_dtype: str,
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_scale: torch.Tensor | None = None,
    exp_avg_sq_scale: torch.Tensor | None = None,
    param_out: torch.Tensor | None = None,
) -> None:
    """The bandwidth floor of ``adam_update_compact``: its loads and stores, no arithmetic.

    Every byte of the states (and scales) is read and written back unchanged;
    ``param_out`` receives the master.
    """
    KERNEL.ops().touch_compact(
        master, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param_out,
        state_dtype == "int8", 0,
    )  # fmt: skip
