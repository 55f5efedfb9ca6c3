"""Half-precision matmuls on a CPU without units for them, computed from fp32 copies of their operands.

torch runs a bf16 (or fp16) matmul on a CPU that has no bf16 units (AVX2 only, AVX-512 without BF16) in its
scalar fallback kernels. On an AMD EPYC Zen 3 (2 vCPUs, AVX2, torch 2.13) a bf16 ``mm`` ran at 0.56 GFLOP/s
against fp32's 34, and a 4-layer, 512-wide GPT's bf16 training step took 39.3 s against fp32's 0.95 s
(``benchmarks/bench_cpu_matmul.py``). Casting the operands up, one fp32 matmul, and rounding the product back
to the compute precision gives the fallback's value up to the order of its fp32 sums (the fallback accumulates
in fp32 too) at fp32's speed plus the casts: that step took 0.99 s.

:class:`HalfMatmulsInFp32` does that, as a dispatch mode, for the aten matmuls a model's forward and backward
reach (``linear`` and ``matmul`` come down to them) and for the CPU flash attention's backward;
:func:`cpu_matmul_mode` says whether a run needs it:

* ``fp32``: always, when the compute device is the CPU and the precision is bf16 or fp16;
* ``native``: never (torch's own kernels, as a plain PyTorch run on this machine computes);
* ``auto``: where the CPU has no units for the compute precision (:func:`infinity.runtime.hardware.fast_precision`
  for bf16; ``avx512_fp16`` or ``amx_fp16`` for fp16).

A dispatch mode is thread-local: the engine enters it around the model's forward and around the backward
(which runs on the calling thread for a CPU graph), so a recomputed forward inside the backward is covered too.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from infinity.runtime.hardware import CPU_MATMUL_CHOICES, cpu_flags, fast_precision, slow_precision_warning

__all__ = ["CPU_MATMUL_CHOICES", "HalfMatmulsInFp32", "cpu_matmul_mode", "matmuls_in_fp32", "run_matmul_mode"]

FP16_CPU_FLAGS = ("amx_fp16", "avx512_fp16")
"""/proc/cpuinfo flags of a CPU with fp16 units."""

_HALF = (torch.bfloat16, torch.float16)
_aten = torch.ops.aten
_MATMULS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
                      _aten.mv.default, _aten.addmv.default})
_IN_FP32 = _MATMULS | {
    # The CPU flash attention's backward is matmuls too: in bf16 without bf16 units 9x its fp32 time (0.61 against
    # 0.07 s a step of a 4-layer, 512-wide GPT on 4 x 256 tokens, Zen 3). Its forward runs as fast in bf16.
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}


class HalfMatmulsInFp32(TorchDispatchMode):
    """Computes a CPU matmul (or the flash attention's backward) whose operands are bf16 or fp16 in fp32 and
    rounds what it returns to their dtype; every other op (and one with ``out=``, or on another device) runs as it
    is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _IN_FP32 and "out" not in kwargs:
            dtype = _half_cpu_dtype(args)
            if dtype is not None:
                def up(a):
                    return a.float() if isinstance(a, torch.Tensor) and a.dtype == dtype else a

                result = func(*map(up, args), **{k: up(v) for k, v in kwargs.items()})
                if isinstance(result, tuple):
                    return tuple(r.to(dtype) if isinstance(r, torch.Tensor) else r for r in result)
                return result.to(dtype)
        return func(*args, **kwargs)


def _half_cpu_dtype(args) -> torch.dtype | None:
    """The first operand's dtype when it is a CPU tensor in bf16 or fp16 (the operands the op rounds to it share
    it: torch refuses a matmul of mixed dtypes), else None."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None or first.device.type != "cpu" or first.dtype not in _HALF:
        return None
    return first.dtype


def matmuls_in_fp32(choice: str, precision: str, device: torch.device | str) -> bool:
    """Whether a run computing in ``precision`` (``fp32``, ``bf16``, ``fp16``) on ``device`` takes its matmuls
    through fp32 under ``choice`` (:data:`CPU_MATMUL_CHOICES`; see the module's docstring)."""
    if choice not in CPU_MATMUL_CHOICES:
        raise ValueError(f"cpu_matmul_precision must be one of {', '.join(CPU_MATMUL_CHOICES)}, got {choice!r}")
    if precision not in ("bf16", "fp16") or torch.device(device).type != "cpu" or choice == "native":
        return False
    if choice == "fp32":
        return True
    if precision == "bf16":
        return fast_precision("cpu").precision != "bf16"
    flags = cpu_flags()
    return flags is None or not any(f in flags for f in FP16_CPU_FLAGS)


def run_matmul_mode(choice: str, precision: str, device: torch.device, *, logger: logging.Logger):
    """:func:`cpu_matmul_mode` for a run, said once in the run's ``logger``: the matmuls taken through fp32, or else
    the warning of a precision this device computes slowly."""
    mode = cpu_matmul_mode(choice, precision, device)
    if mode is HalfMatmulsInFp32:
        logger.info("%s matmuls on the CPU are computed in fp32 and rounded (cpu_matmul_precision %s)", precision,
                    choice)
    else:
        slow = slow_precision_warning(precision, device.type)
        if slow is not None:
            logger.warning("%s", slow)
    return mode


def cpu_matmul_mode(choice: str, precision: str, device: torch.device | str):
    """A factory of the context a forward or backward runs in: :class:`HalfMatmulsInFp32` where
    :func:`matmuls_in_fp32` says so, else a context that does nothing."""
    if matmuls_in_fp32(choice, precision, device):
        return HalfMatmulsInFp32
    return contextlib.nullcontext
