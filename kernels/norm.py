"""The squared L2 norm of a flat CPU tensor in fp64, in the C++ kernel (``csrc/sq_norm.cpp``)."""

from __future__ import annotations

import torch

from . import extension
from .adam import backend, check_num_threads

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def takes(values: torch.Tensor) -> bool:
    """Whether :func:`sq_norm_fp64` takes ``values``: one contiguous fp32/bf16/fp16 CPU tensor."""
    return values.dtype in _DTYPES and values.device.type == "cpu" and values.is_contiguous()


def sq_norm_fp64(values: torch.Tensor, *, num_threads: int | None = None) -> float | None:
    """The sum of ``values``' squares in fp64 (one contiguous fp32/bf16/fp16 CPU tensor), in one pass with the
    GIL released; the same tensor always gives the same bits, on any number of threads (``num_threads`` as for
    ``adam_step``). None where the kernel is not used (``backend()`` is ``torch``): the caller sums in torch ops."""
    if not takes(values):
        raise ValueError(f"sq_norm_fp64 takes a contiguous float32/bfloat16/float16 CPU tensor, got {values.dtype} "
                         f"on {values.device}{'' if values.is_contiguous() else ', not contiguous'}")
    threads = check_num_threads(num_threads)
    if backend() != "cpp":
        return None
    return extension.KERNEL.ops().sq_norm_fp64(values.reshape(-1), threads)
