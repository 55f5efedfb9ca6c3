"""The full training state of a partitioned parameter, as ``deepspeed.utils`` reads and writes it:
``safe_get_full_fp32_param``, ``safe_set_full_fp32_param``, ``safe_get_full_optimizer_state`` and
``safe_set_full_optimizer_state`` (:mod:`infinity.engine.gathered`). Each is collective: every rank calls it with
the same parameter. A parameter no engine trains (a frozen one, one built elsewhere) has no fp32 master and no
optimizer state: the reads return None, as DeepSpeed's do, and the writes are refused.

Setting a master sets the compute shard too, so the next forward sees the value, and an optimizer state may be
set once a step has made it."""

from __future__ import annotations

import torch

from infinity.engine.gathered import engine_of

OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq")
"""The optimizer state keys, as ``torch.optim.AdamW`` names them."""


def _trained_by(param: torch.Tensor):
    engine = engine_of(param)
    return engine if engine is not None and param.requires_grad else None


def _check_key(optim_state_key: str) -> None:
    if optim_state_key not in OPTIMIZER_STATES:
        raise ValueError(f"optim_state_key={optim_state_key!r}: one of {', '.join(OPTIMIZER_STATES)}")


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The parameter's full fp32 master, on the compute device; None where no engine trains it."""
    engine = _trained_by(param)
    return None if engine is None else engine.whole_params().read(param)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``value`` (of the parameter's shape, the same on every rank) its fp32 master and compute shard."""
    engine = _trained_by(param)
    if engine is None:
        raise ValueError(f"safe_set_full_fp32_param: the parameter of shape {tuple(param.shape)} is not trained by "
                         "an engine (frozen, or not initialized): it has no fp32 master; set a frozen one with "
                         "zero.GatheredParameters(param, modifier_rank=0)")
    engine.whole_params().write(param, value)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The parameter's full optimizer state (``exp_avg`` or ``exp_avg_sq``) in fp32, on the compute device; None
    where no engine trains it. Zeros before the first step."""
    _check_key(optim_state_key)
    engine = _trained_by(param)
    return None if engine is None else engine.whole_params().read(param, optim_state_key)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Make ``value`` (of the parameter's shape, the same on every rank) that optimizer state, after a step."""
    _check_key(optim_state_key)
    engine = _trained_by(param)
    if engine is None:
        raise ValueError(f"safe_set_full_optimizer_state: the parameter of shape {tuple(param.shape)} is not "
                         "trained by an engine (frozen, or not initialized): it has no optimizer state")
    engine.whole_params().write(param, value, optim_state_key)


def safe_get_full_grad(param: torch.Tensor):
    """Not offered: each gradient is reduced into its rank's shard as backward makes it, and with the step
    overlapped with backward a sub-group is updated (its gradient consumed) before backward ends."""
    raise NotImplementedError("safe_get_full_grad is not supported: gradients are reduced into shards and consumed "
                              "by the step as backward makes them; engine.get_global_grad_norm() gives their norm")
