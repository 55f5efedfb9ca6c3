"""``deepspeed.runtime.utils.see_memory_usage``: the device's and the host's memory in use, logged at a point of a
script, as DeepSpeed's reports them."""

from __future__ import annotations

import gc

import psutil
import torch
import torch.distributed as dist

from infinity.deepspeed.utils.logging import logger

GIB = 1024 ** 3


def see_memory_usage(message: str, force: bool = False) -> None:
    """With ``force`` (DeepSpeed's calls inside its engine pass False: nothing), on rank 0: ``message``, then the
    device's allocated and reserved memory with their peaks since the last call (CUDA; none on a CPU-only machine),
    then the host's memory in use (total less available), on the ``DeepSpeed`` logger."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()  # what the script dropped is counted as free, as DeepSpeed's does before reading
    logger.info("%s", message)
    if torch.cuda.is_available():
        logger.info("MA %.2f GB Max_MA %.2f GB CA %.2f GB Max_CA %.2f GB", torch.cuda.memory_allocated() / GIB,
                    torch.cuda.max_memory_allocated() / GIB, torch.cuda.memory_reserved() / GIB,
                    torch.cuda.max_memory_reserved() / GIB)
        torch.cuda.reset_peak_memory_stats()  # the next call's peaks are its own
    host = psutil.virtual_memory()
    logger.info("CPU Virtual Memory:  used = %.2f GB, percent = %s%%", (host.total - host.available) / GIB,
                host.percent)
