"""Learning rate: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math

__all__ = ["lr_at"]


def lr_at(step: int, *, peak_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0) -> float:
    """The learning rate of optimizer step ``step`` (0-based).

    Steps ``0 .. warmup_steps - 1`` ramp linearly up to ``peak_lr`` (step 0 uses
    ``peak_lr / warmup_steps``, never 0; the last warmup step uses ``peak_lr``);
    the remaining steps follow half a cosine from ``peak_lr`` down to
    ``min_lr``, reached at step ``total_steps - 1`` and held after.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if warmup_steps < 0 or total_steps <= 0:
        raise ValueError(f"need warmup_steps >= 0 and total_steps > 0, got {warmup_steps} and {total_steps}")
    if not 0.0 <= min_lr <= peak_lr:
        raise ValueError(f"need 0 <= min_lr <= peak_lr, got min_lr={min_lr} peak_lr={peak_lr}")
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    decay_steps = total_steps - warmup_steps
    if decay_steps <= 0:
        return min_lr
    progress = min(1.0, (step - warmup_steps + 1) / decay_steps)
    return min_lr + 0.5 * (peak_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
