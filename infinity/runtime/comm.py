"""Collectives over the data-parallel group, each counted in bytes.

One process needs no process group: every collective is then the identity.
Bytes are counted the way the ring algorithms move them, per rank:
an all-gather or reduce-scatter of a full tensor of ``B`` bytes moves
``(N - 1) / N * B``; an all-reduce moves twice that.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from infinity.runtime.trace import Timeline

logger = logging.getLogger(__name__)

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_in(group: "dist.ProcessGroup | None" = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if _distributed() else 0


def local_rank_and_size(*, default_size: int = 1) -> tuple[int, int]:
    """(this rank's index, the ranks) on this machine, from torchrun's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``:
    (0, ``default_size``) where they are unset. Raises ``ValueError`` naming the variable where one is not a whole
    number, or where the rank is not one of the ranks."""
    values = {}
    for name, default in (("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", default_size)):
        text = os.environ.get(name, "").strip()
        try:
            values[name] = int(text) if text else default
        except ValueError:
            raise ValueError(f"environment variable {name}={text!r} is not a whole number "
                             "(torchrun sets LOCAL_RANK and LOCAL_WORLD_SIZE)") from None
    rank, size = values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"]
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"environment variables LOCAL_RANK={rank} and LOCAL_WORLD_SIZE={size} name no rank "
                         "of the ranks on this machine")
    return rank, size


def process_group_backend() -> str:
    """The backend for ``torch.distributed.init_process_group`` on this machine: one GPU per rank where it has one
    for each of its ranks (torchrun's ``LOCAL_RANK`` picks it, made the current device here), NCCL for device
    tensors and gloo for the host ones (the gradient norm, flags, checkpoint and metric reductions). Otherwise
    gloo alone, and the ranks compute on the CPU."""
    local_rank, local_ranks = local_rank_and_size()
    if torch.cuda.is_available() and local_ranks <= torch.cuda.device_count():
        torch.cuda.set_device(local_rank)
        return "cpu:gloo,cuda:nccl"
    return "gloo"


class Collectives:
    """The engine's only door to torch.distributed."""

    def __init__(self, group: "dist.ProcessGroup | None" = None, *, timeline: "Timeline | None" = None):
        self.distributed = _distributed()
        self.group = group
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.rank = rank_in(group)
        self.backend = dist.get_backend(group) if self.distributed else None
        # NCCL alone takes CUDA tensors only; the engine's host-side collectives (the gradient norm, the
        # overflow flag, initial values, checkpoint flags) then go through a device copy. A group made as
        # "cpu:gloo,cuda:nccl" (what `infinity train` makes) takes host tensors as they are.
        self._host_via_device = self.backend == "nccl"
        self.nbytes: dict[str, int] = defaultdict(int)
        self.seconds = 0.0
        self._timeline = timeline  # each collective is a span on its "collectives" track

    def all_gather_into(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Gather every rank's ``shard`` into ``full`` (``world_size * shard.numel()`` elements)."""
        if self.world_size == 1:
            if full.data_ptr() != shard.data_ptr():
                full.copy_(shard)
            return
        start = time.perf_counter()
        self._on_backend_device(full, lambda t: _all_gather_single(t, shard.to(t.device), group=self.group))
        self._count("all_gather", full.numel() * full.element_size(), start)

    def reduce_scatter_mean(self, shard_out: torch.Tensor, full: torch.Tensor) -> None:
        """``shard_out`` = this rank's slice of the mean of ``full`` over ranks."""
        if self.world_size == 1:
            shard_out.copy_(full)
            return
        start = time.perf_counter()
        _reduce_scatter_single(shard_out, full, op=dist.ReduceOp.SUM, group=self.group)
        shard_out.div_(self.world_size)
        self._count("reduce_scatter", full.numel() * full.element_size(), start)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(tensor, dist.ReduceOp.SUM)

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(tensor, dist.ReduceOp.MAX)

    def least_over_ranks(self, value: int) -> int:
        """The least of every rank's ``value`` (each rank calls it at the same point)."""
        if self.world_size == 1:
            return value
        return -int(self.all_reduce_max(torch.tensor([-value], dtype=torch.int64)).item())

    def _all_reduce(self, tensor: torch.Tensor, op) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        start = time.perf_counter()
        self._on_backend_device(tensor, lambda t: dist.all_reduce(t, op=op, group=self.group))
        self._count("all_reduce", 2 * tensor.numel() * tensor.element_size(), start)
        return tensor

    def broadcast_from_first(self, tensor: torch.Tensor) -> None:
        """Make every rank hold rank 0's ``tensor`` (used once, at initialize)."""
        self.broadcast_from(tensor, 0)

    def broadcast_from(self, tensor: torch.Tensor, rank: int) -> None:
        """Make every rank hold ``rank``'s ``tensor`` (``rank`` within the group)."""
        if self.world_size == 1:
            return
        src = dist.get_global_rank(self.group, rank) if self.group else rank
        self._on_backend_device(tensor, lambda t: dist.broadcast(t, src=src, group=self.group))

    def _on_backend_device(self, tensor: torch.Tensor, collective) -> None:
        """Run ``collective`` on ``tensor``, or on a device copy of a host tensor where the backend is NCCL alone."""
        if not (self._host_via_device and tensor.device.type == "cpu"):
            collective(tensor)
            return
        on_device = tensor.to(_current_cuda_device(), copy=True)
        collective(on_device)
        tensor.copy_(on_device)  # a synchronous copy down: the host reads the result next

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def _count(self, name: str, full_nbytes: int, start: float) -> None:
        end = time.perf_counter()
        self.nbytes[name] += full_nbytes * (self.world_size - 1) // self.world_size
        self.seconds += end - start
        if self._timeline is not None:
            self._timeline.add("collectives", name, start, end)

    def snapshot(self) -> dict:
        return {f"{name}_nbytes": n for name, n in sorted(self.nbytes.items())} | {"seconds": self.seconds}


def _current_cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())
