"""``deepspeed.utils``' ``logger`` and ``log_dist``: a script's messages on the ranks it names, as DeepSpeed's."""

from __future__ import annotations

import logging

import torch.distributed as dist

logger = logging.getLogger("DeepSpeed")
"""DeepSpeed's logger, by DeepSpeed's name (a script's ``logger.info(...)``; its handlers are the script's)."""


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """``message`` on :data:`logger` at ``level`` as ``[Rank r] message``, as DeepSpeed's: in a process without a
    process group always (r is -1 there); else on the ranks in ``ranks`` (``[-1]``: every rank; None: none)."""
    if dist.is_initialized():
        rank = dist.get_rank()
        ranks = ranks or []
        if not ranks or (ranks[0] != -1 and rank not in ranks):
            return
    else:
        rank = -1
    logger.log(level, "[Rank %d] %s", rank, message)
