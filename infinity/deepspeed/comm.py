"""``deepspeed.comm`` (``from deepspeed import comm as dist``): the process group's verbs as DeepSpeed scripts call
them, over ``torch.distributed``. Made by :func:`init_distributed`; without one (a single process), the rank is 0
and the world one process."""

from __future__ import annotations

import os

import torch.distributed as _dist
from torch.distributed import ReduceOp

from infinity.deepspeed.initialize import init_distributed

__all__ = ["ReduceOp", "all_gather", "all_reduce", "barrier", "broadcast", "get_local_rank", "get_rank",
           "get_world_size", "init_distributed", "is_initialized", "new_group"]


def is_initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def get_rank(group=None) -> int:
    return _dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return _dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier(group=None) -> None:
    if is_initialized():
        _dist.barrier(group=group)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op) if is_initialized() else None


def broadcast(tensor, src, group=None, async_op=False):
    return _dist.broadcast(tensor, src=src, group=group, async_op=async_op) if is_initialized() else None


def all_gather(tensor_list, tensor, group=None, async_op=False):
    if is_initialized():
        return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    tensor_list[0].copy_(tensor)
    return None


def new_group(ranks=None, timeout=None, backend=None, **options):
    """A process group of ``ranks`` (None: every rank), as ``torch.distributed.new_group`` makes it; every rank of
    the run calls it, as there."""
    if timeout is not None:
        options["timeout"] = timeout
    return _dist.new_group(ranks=ranks, backend=backend, **options)
