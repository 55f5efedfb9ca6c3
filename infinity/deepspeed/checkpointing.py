"""``deepspeed.checkpointing``: activation checkpointing as DeepSpeed scripts call it, ``configure(...)`` then
``checkpoint(function, *args)``, done by ``torch.utils.checkpoint`` (non-reentrant), under which the engine fetches a
module's parameters again for the recomputation as it does for the forward. Partitioning or moving the saved
activations (``partition_activations``, ``checkpoint_in_cpu``) is not done: they stay where the forward made them."""

from __future__ import annotations

import logging

import torch.utils.checkpoint

logger = logging.getLogger(__name__)

_configured = False


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """Accepted as DeepSpeed's; ``mpu_`` (model parallelism) is refused."""
    global _configured
    if mpu_ is not None:
        raise ValueError("checkpointing.configure(mpu_=...): model parallelism is not supported (the engine is data "
                         "parallel)")
    if partition_activations or checkpoint_in_cpu:
        logger.info("checkpointing: partition_activations / checkpoint_in_cpu are not done; the checkpointed "
                    "activations stay where the forward made them")
    _configured = True


def is_configured() -> bool:
    return _configured


def checkpoint(function, *args):
    """``function(*args)``, its activations recomputed in backward instead of kept."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
