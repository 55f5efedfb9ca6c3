"""``"auto"`` values of the DeepSpeed configs that Hugging Face users carry, filled from the run's own settings.

Hugging Face's Trainer replaces ``"auto"`` before DeepSpeed sees the config;
``infinity train`` does the same from its flags (:func:`fill_auto`), and any
``"auto"`` left where a number is needed is rejected by
:meth:`InfinityConfig.from_deepspeed`, naming the key. An ``"auto"`` under a
key that has no meaning here (``reduce_bucket_size``, the ``scheduler`` block
when nothing reads it) is accepted with that key.

The ZeRO sizes follow the Trainer's formulas from the model's hidden size
``h``: ``stage3_prefetch_bucket_size`` = 0.9 h², ``stage3_param_persistence_threshold`` = 10 h.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

logger = logging.getLogger(__name__)

AUTO = "auto"


def fill_auto(raw: dict, values: dict[str, Any], *, steps: int | None = None, warmup: int | None = None,
              lr: float | None = None, min_lr: float | None = None, hidden_size: int | None = None) -> dict:
    """A copy of ``raw`` with each ``"auto"`` whose value the run knows replaced by it.

    ``values`` maps dotted keys (``optimizer.params.eps``) to their values;
    the learning-rate schedule and the model's hidden size fill the
    ``scheduler.params`` and ZeRO bucket keys.
    """
    out = copy.deepcopy(raw)
    known = dict(values)
    if lr is not None:
        known.setdefault("optimizer.params.lr", lr)
        known.setdefault("scheduler.params.warmup_max_lr", lr)
        known.setdefault("scheduler.params.cos_min_ratio", (min_lr or 0.0) / lr if lr else 0.0)
    if min_lr is not None:
        known.setdefault("scheduler.params.warmup_min_lr", 0.0)
    if warmup is not None:
        known.setdefault("scheduler.params.warmup_num_steps", warmup)
    if steps is not None:
        known.setdefault("scheduler.params.total_num_steps", steps)
    if hidden_size:
        known.setdefault("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size))
        known.setdefault("zero_optimization.stage3_param_persistence_threshold", 10 * hidden_size)
        known.setdefault("zero_optimization.reduce_bucket_size", hidden_size * hidden_size)
    filled = []

    def walk(block: dict, prefix: str) -> None:
        for key, value in block.items():
            dotted = f"{prefix}{key}"
            if value == AUTO and dotted in known:
                block[key] = known[dotted]
                filled.append(dotted)
            elif isinstance(value, dict):
                walk(value, f"{dotted}.")

    walk(out, "")
    if filled:
        logger.info("config \"auto\" values filled from this run: %s",
                    ", ".join(f"{k}={_lookup(out, k)!r}" for k in filled))
    return out


def _lookup(block: dict, dotted: str):
    for part in dotted.split("."):
        block = block[part]
    return block
