"""Learning-rate schedules: ours (``infinity train --lr-schedule``) and DeepSpeed's ``scheduler`` blocks.

Every schedule here is a pure function of the optimizer step: ``lr_at(step)``
is the learning rate that optimizer step ``step`` (0-based) runs with. Nothing
is stepped or stored, so a resumed run asks for the step it resumes at.

Ours (:func:`lr_at`): a linear warmup to ``peak_lr`` then one of

- ``cosine``: half a cosine down to ``min_lr`` at the last step;
- ``linear``: a straight line down to ``min_lr`` at the last step;
- ``constant``: ``peak_lr`` to the end;
- ``wsd`` (warmup-stable-decay): ``peak_lr`` until the last ``decay_fraction``
  of the steps after warmup, then a straight line down to ``min_lr``.

DeepSpeed's (:class:`DeepSpeedScheduler`): ``WarmupLR``, ``WarmupDecayLR`` and
``WarmupCosineLR`` with their parameter names, defaults and formulas
(``deepspeed/runtime/lr_schedules.py``). DeepSpeed's engine steps its scheduler
*after* each optimizer step, so optimizer step ``k`` runs with the value at
``last_batch_iteration = k - 1``, and step 0 with the value the scheduler set
when it was built (``warmup_min_lr`` for WarmupLR and WarmupDecayLR, 0 for
WarmupCosineLR). We reproduce that, so a DeepSpeed config gives the same
learning rates here as there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["SCHEDULES", "DEEPSPEED_SCHEDULERS", "DeepSpeedScheduler", "lr_at", "scheduler_from_deepspeed"]

SCHEDULES = ("cosine", "linear", "constant", "wsd")
DEEPSPEED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
DEFAULT_DECAY_FRACTION = 0.2
"""The share of the post-warmup steps that ``wsd`` spends decaying (the "cooldown")."""


def lr_at(step: int, *, peak_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0,
          schedule: str = "cosine", decay_fraction: float = DEFAULT_DECAY_FRACTION) -> float:
    """The learning rate of optimizer step ``step`` (0-based).

    Steps ``0 .. warmup_steps - 1`` ramp linearly up to ``peak_lr`` (step 0 uses
    ``peak_lr / warmup_steps``, never 0; the last warmup step uses ``peak_lr``);
    the remaining steps follow ``schedule`` (see the module's docstring), which
    reaches ``min_lr`` at step ``total_steps - 1`` (``constant`` excepted) and
    holds it after.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if warmup_steps < 0 or total_steps <= 0:
        raise ValueError(f"need warmup_steps >= 0 and total_steps > 0, got {warmup_steps} and {total_steps}")
    if not 0.0 <= min_lr <= peak_lr:
        raise ValueError(f"need 0 <= min_lr <= peak_lr, got min_lr={min_lr} peak_lr={peak_lr}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; schedules: {', '.join(SCHEDULES)}")
    if not 0.0 < decay_fraction <= 1.0:
        raise ValueError(f"decay_fraction must be in (0, 1], got {decay_fraction}")
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak_lr
    decay_steps = total_steps - warmup_steps
    if decay_steps <= 0:
        return min_lr
    if schedule == "wsd":
        cooldown = max(1, round(decay_fraction * decay_steps))
        stable_until = total_steps - cooldown  # first step of the cooldown
        if step < stable_until:
            return peak_lr
        progress = min(1.0, (step - stable_until + 1) / cooldown)
        return peak_lr - (peak_lr - min_lr) * progress
    progress = min(1.0, (step - warmup_steps + 1) / decay_steps)
    if schedule == "linear":
        return peak_lr - (peak_lr - min_lr) * progress
    return min_lr + 0.5 * (peak_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class DeepSpeedScheduler:
    """A DeepSpeed ``scheduler`` block: ``{"type": ..., "params": {...}}``, with DeepSpeed's names and defaults."""

    type: str
    """``WarmupLR``, ``WarmupDecayLR`` or ``WarmupCosineLR``."""
    warmup_min_lr: float = 0.0
    """WarmupLR, WarmupDecayLR: the learning rate warmup starts from."""
    warmup_max_lr: float | None = None
    """WarmupLR, WarmupDecayLR: the learning rate warmup ends at; None: the optimizer's ``lr``."""
    warmup_num_steps: int = 1000
    """Steps of warmup (DeepSpeed uses at least 2)."""
    warmup_type: str = "log"
    """``log`` (DeepSpeed's default: ``log(i + 1) / log(warmup_num_steps)``) or ``linear`` (``i / warmup_num_steps``)."""
    total_num_steps: int | None = None
    """WarmupDecayLR, WarmupCosineLR (required there): the step at which the decay ends."""
    warmup_min_ratio: float = 0.0
    """WarmupCosineLR: warmup starts at this fraction of the optimizer's ``lr``."""
    cos_min_ratio: float = 0.0001
    """WarmupCosineLR: the cosine ends at this fraction of the optimizer's ``lr``."""
    last_batch_iteration: int = -1
    """The iteration the scheduler was built at (-1: a fresh run)."""

    def __post_init__(self):
        if self.type not in DEEPSPEED_SCHEDULERS:
            raise ValueError(f"scheduler.type {self.type!r} is not supported; supported: {', '.join(DEEPSPEED_SCHEDULERS)}")
        if self.warmup_type not in ("log", "linear"):
            raise ValueError(f"scheduler.params.warmup_type must be 'log' or 'linear', got {self.warmup_type!r}")
        if not isinstance(self.warmup_num_steps, int) or self.warmup_num_steps < 0:
            raise ValueError(f"scheduler.params.warmup_num_steps must be an int >= 0, got {self.warmup_num_steps!r}")
        if self.type != "WarmupLR":
            if self.total_num_steps is None:
                raise ValueError(f"scheduler.params.total_num_steps is required by {self.type}")
            if not isinstance(self.total_num_steps, int) or self.total_num_steps <= 0:
                raise ValueError(f"scheduler.params.total_num_steps must be a positive int, got {self.total_num_steps!r}")
        if not isinstance(self.last_batch_iteration, int) or self.last_batch_iteration < -1:
            raise ValueError(f"scheduler.params.last_batch_iteration must be an int >= -1, got {self.last_batch_iteration!r}")

    def value_at_iteration(self, iteration: int, optimizer_lr: float) -> float:
        """DeepSpeed's ``get_lr()`` with ``last_batch_iteration = iteration`` (-1: before its first ``step()``)."""
        warmup = max(2, self.warmup_num_steps)

        def warmup_gamma() -> float:
            if self.warmup_type == "log":
                return math.log(iteration + 1) / math.log(warmup)
            return iteration / warmup

        if self.type == "WarmupCosineLR":
            if iteration < 0:
                return 0.0
            if iteration < warmup:
                ratio = self.warmup_min_ratio + warmup_gamma() * (1.0 - self.warmup_min_ratio)
            else:
                real_last_step = iteration - warmup + 1
                real_total_steps = self.total_num_steps - warmup
                if real_total_steps <= 0:
                    raise ValueError(f"scheduler.params.total_num_steps={self.total_num_steps} must exceed "
                                     f"warmup_num_steps={warmup} for WarmupCosineLR")
                cosine = (1 + math.cos(math.pi * real_last_step / real_total_steps)) / 2
                ratio = max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)
            return optimizer_lr * ratio
        min_lr = self.warmup_min_lr
        max_lr = optimizer_lr if self.warmup_max_lr is None else self.warmup_max_lr
        if iteration < 0:
            return min_lr
        if iteration < warmup:
            gamma = warmup_gamma()
        elif self.type == "WarmupLR":
            gamma = 1.0
        else:  # WarmupDecayLR
            gamma = max(0.0, (self.total_num_steps - iteration) / max(1.0, self.total_num_steps - warmup))
        return min_lr + (max_lr - min_lr) * gamma

    def lr_at(self, step: int, optimizer_lr: float) -> float:
        """The learning rate of optimizer step ``step`` (0-based), as DeepSpeed's engine would run it."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.value_at_iteration(self.last_batch_iteration + step, optimizer_lr)


def scheduler_from_deepspeed(block: Any) -> DeepSpeedScheduler:
    """A DeepSpeed ``scheduler`` block translated; unknown types and parameters are refused by name."""
    if not isinstance(block, dict):
        raise ValueError(f"scheduler must be a JSON object, got {type(block).__name__}")
    unknown = set(block) - {"type", "params"}
    if unknown:
        raise ValueError(f"unknown config key(s) in scheduler: {', '.join(sorted(map(repr, unknown)))}")
    if "type" not in block:
        raise ValueError(f"scheduler.type is required; one of {', '.join(DEEPSPEED_SCHEDULERS)}")
    if block["type"] not in DEEPSPEED_SCHEDULERS:  # before its params: OneCycle's are not typos, the type is refused
        raise ValueError(f"scheduler.type {block['type']!r} is not supported; supported: "
                         f"{', '.join(DEEPSPEED_SCHEDULERS)}")
    params = block.get("params") or {}
    if not isinstance(params, dict):
        raise ValueError(f"scheduler.params must be a JSON object, got {type(params).__name__}")
    accepted = {
        "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"},
        "WarmupDecayLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration",
                          "total_num_steps"},
        "WarmupCosineLR": {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                           "last_batch_iteration"},
    }[block["type"]]
    for key, value in params.items():
        if key not in accepted:
            raise ValueError(f"unknown config key scheduler.params.{key!r} for scheduler.type {block['type']!r}")
        if isinstance(value, (list, tuple)):
            raise ValueError(f"scheduler.params.{key}: one value for all parameter groups, got {value!r}")
        if isinstance(value, str) and key != "warmup_type":
            raise ValueError(f"scheduler.params.{key} must be a number, got {value!r}")
    return DeepSpeedScheduler(type=block["type"], **params)
