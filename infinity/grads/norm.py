"""The gradient norm that clipping, fp16 overflow checks and the metrics read: squared norms in fp64.

Why fp64: the sum of squares of every gradient must be finite exactly when every gradient is (the fp16
overflow check reads it), and an fp32 square overflows above 1.8e19.

Why in chunks through one small buffer: widening a whole sub-group to fp64 (``grads.double().pow(2)``)
allocated 16 bytes a gradient every step. Blocks that size come from fresh pages, which the kernel zeroes:
for an 85M-parameter model that was 1.4 GB zeroed a step and 0.6 s of a 1.6 s step on two cores
(``perf``: ``clear_page_erms``), and it grows with the model (208 GB a step at 13B). A buffer of
``HOST_CHUNK_NUMEL`` fp64 stays in the cache and in malloc's heap.

Where the C++ kernel is built, host tensors are summed there instead (``kernels.sq_norm_fp64``): one pass with
the GIL released, as the optimizer's worker thread takes each sub-group's norm beside backward.
"""

from __future__ import annotations

import math

import torch

from infinity import kernels

HOST_CHUNK_NUMEL = 1 << 17
"""Elements per chunk in host memory: a 1 MiB fp64 buffer, which stays in L2/L3."""

DEVICE_CHUNK_NUMEL = 1 << 24
"""Elements per chunk on an accelerator, whose caching allocator reuses blocks (no fresh pages there)."""


def sq_norm_fp64(values: torch.Tensor, *, num_threads: int | None = None) -> float:
    """The squared L2 norm of ``values`` (any float dtype, one flat tensor) summed in fp64.

    The same tensor always gives the same bits: chunk sums are added in chunk order. ``num_threads``: the C++
    kernel's team (None: torch's count), the optimizer's own where its worker takes the norm.
    """
    if values.device.type != "cpu":
        # One host sync at the end, not one per chunk.
        return float(sum(chunk.double().pow(2).sum() for chunk in values.split(DEVICE_CHUNK_NUMEL)))
    if kernels.norm.takes(values):
        # The C++ kernel: one pass, without the GIL (the optimizer's worker calls this while backward runs).
        total = kernels.sq_norm_fp64(values, num_threads=num_threads)
        if total is not None:
            return total
    buffer = torch.empty(min(HOST_CHUNK_NUMEL, values.numel()), dtype=torch.float64)
    total = 0.0
    for chunk in values.split(HOST_CHUNK_NUMEL):
        wide = buffer[: chunk.numel()]
        wide.copy_(chunk)
        wide.mul_(wide)
        total += float(wide.sum())
    return total


def global_grad_norm(sq_norm_local: float, comm) -> float:
    """The L2 norm over every rank's gradients, from each rank's squared norm."""
    total = torch.tensor([sq_norm_local], dtype=torch.float64)
    comm.all_reduce_sum(total)
    return math.sqrt(float(total))
