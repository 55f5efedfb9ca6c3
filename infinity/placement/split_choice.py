"""How many of the first sub-groups ``offload_optimizer.device: auto`` keeps on the device: the step-time model's
choice among the counts the device budget allows.

Each count from 0 (every sub-group offloaded) to the longest run of first sub-groups that fits
``zero_optimization.device_memory_budget`` moves a different traffic: fewer states for the CPU Adam and the disk,
fewer gradient slices down and compute shards up, more work for the device optimizer. The model
(:func:`~infinity.placement.step_time.predict_step`, fed with the figures ``infinity bench --machine`` cached)
predicts the step for each, and the choice is the smallest count whose step is within :data:`SPLIT_TOLERANCE`
of the best: device memory left free serves activations and prefetching, so it is kept where taking it would
not make the step faster. Where a host step is hidden behind backward (the sub-groups whose gradients are final
first are stepped while the later layers still run), that is no sub-group at all; where the host's step shows,
the first sub-groups (whose gradients are final last, with nothing left to hide their step behind) go first.

Without cached figures (or where the model lacks a figure the run needs, a disk not measured) the rule is the
budget's alone: the longest run that fits, and one INFO line says so. A ``ratio`` (DeepSpeed's) is never
second-guessed.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from infinity.config.schema import InfinityConfig
from infinity.config.tier_names import OffloadDevice
from infinity.placement.estimate_split import device_sub_group_count, grad_itemsize_of, move_to_device
from infinity.placement.optimizer_split import BUDGET_KEY
from infinity.placement.step_time import StepPrediction, predict_step, traffic_from_estimate
from infinity.runtime.machine_figures import load_cached

__all__ = ["SPLIT_TOLERANCE", "SplitChoice", "StepShape", "apply_optimizer_split", "choose_count", "choose_split",
           "recomputes", "split_figures", "step_shape_of"]

logger = logging.getLogger(__name__)

SPLIT_TOLERANCE = 0.02
"""A count whose predicted step is within this fraction of the best is as good: the smallest such count wins."""

HF_SEQ_LEN_CAP = 2048
"""A transformers model's step is predicted at most this long a sequence (its position limit is often far longer
than what it is trained on)."""


@dataclass(frozen=True, slots=True)
class StepShape:
    """The model's shape and a micro-batch's tokens, as the step-time model needs them."""

    layers: int
    """Transformer blocks."""
    width: int
    """The model's width (d_model)."""
    seq_len: int
    """Tokens of a sample."""
    head_params: int
    """Parameters of the output head's matmul (vocabulary x width)."""
    micro_batch: int = 1
    """Samples of a micro-batch."""
    recompute: bool = False
    """The blocks are recomputed in backward (activation checkpointing): one more forward a step."""

    def traffic_shape(self) -> dict:
        """:func:`~infinity.placement.step_time.traffic_from_estimate`'s ``shape``."""
        return {"layers": self.layers, "width": self.width, "seq_len": self.seq_len, "head_params": self.head_params}


def step_shape_of(model, *, micro_batch: int = 1, seq_len: int | None = None,
                  recompute: bool | None = None) -> StepShape | None:
    """The shape of ``model`` (our GPT or its config, or a transformers model), or None where it says none (the
    model is then taken as a GPT of its parameter count). ``seq_len``: the run's (default: the model's own).
    ``recompute``: whether its blocks are recomputed in backward (default: what a built model says,
    :func:`recomputes`; a config says nothing, so False)."""
    recompute = recomputes(model) if recompute is None else recompute
    cfg = model if hasattr(model, "n_layer") else getattr(model, "config", None)
    if hasattr(cfg, "n_layer") and hasattr(cfg, "d_model"):  # our GPTConfig
        return StepShape(cfg.n_layer, cfg.d_model, seq_len or cfg.seq_len, cfg.vocab_size * cfg.d_model, micro_batch,
                         recompute)
    layers, width = getattr(cfg, "num_hidden_layers", None), getattr(cfg, "hidden_size", None)
    if isinstance(layers, int) and isinstance(width, int):  # a transformers config
        own = getattr(cfg, "max_position_embeddings", None) or HF_SEQ_LEN_CAP
        return StepShape(layers, width, seq_len or min(own, HF_SEQ_LEN_CAP),
                         (getattr(cfg, "vocab_size", 0) or 0) * width, micro_batch, recompute)
    return None


def recomputes(model) -> bool:
    """Whether a built model recomputes its blocks in backward: our GPT's ``checkpoint_every``, a transformers
    model's ``is_activation_checkpointing`` (``is_gradient_checkpointing`` before transformers 5); each set by
    ``activation_checkpointing_enable()`` or ``gradient_checkpointing_enable()``."""
    if isinstance(getattr(model, "checkpoint_every", None), int):
        return model.checkpoint_every > 0
    for flag in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers' newer name first
        if hasattr(type(model), flag) or hasattr(model, flag):
            return getattr(model, flag, False) is True
    return False


@dataclass(frozen=True, slots=True)
class SplitChoice:
    """The step-time model's choice: the predicted step for each count of first sub-groups on the device."""

    device_sub_groups: int
    """The count chosen."""
    predicted_s: tuple[float, ...]
    """The predicted step (seconds) with 0, 1, ... sub-groups on the device, up to the longest run that fits."""
    bound_by: str
    """What binds the chosen count's step."""

    @property
    def fitting_sub_groups(self) -> int:
        """The longest run of first sub-groups within the device budget."""
        return len(self.predicted_s) - 1

    @property
    def chosen_s(self) -> float:
        return self.predicted_s[self.device_sub_groups]

    @property
    def all_offloaded_s(self) -> float:
        return self.predicted_s[0]

    def as_dict(self) -> dict:
        return {"chosen_by": "step-time model", "fitting_sub_groups": self.fitting_sub_groups,
                "predicted_step_s": self.chosen_s, "all_offloaded_step_s": self.all_offloaded_s,
                "best_step_s": min(self.predicted_s), "bound_by": self.bound_by}

    def describe(self) -> str:
        return (f"the step-time model's choice: {self.device_sub_groups} of the {self.fitting_sub_groups} first "
                f"sub-groups that fit {BUDGET_KEY}, predicted step {self.chosen_s:.3g} s (bound by {self.bound_by}) "
                f"against {self.all_offloaded_s:.3g} s with every sub-group offloaded (the smallest count within "
                f"{SPLIT_TOLERANCE:.0%} of the best, {min(self.predicted_s):.3g} s)")


def choose_count(predicted_s: Sequence[float], tolerance: float = SPLIT_TOLERANCE) -> int:
    """The smallest count whose predicted step is within ``tolerance`` of the best."""
    best = min(predicted_s)
    return next(count for count, seconds in enumerate(predicted_s) if seconds <= best * (1.0 + tolerance))


def split_figures():
    """The machine's figures the choice is made with: those ``infinity bench --machine`` cached, or None (never
    measured here: a split is decided at ``initialize``, which does not wait for a measurement)."""
    return load_cached()


def choose_split(est: dict, config: InfinityConfig, device_numels: Sequence[int], *, shape: StepShape | None,
                 crossings: bool) -> SplitChoice | None:
    """The count among ``0 .. len(device_numels) - 1`` (``device_numels[k]``: elements of the first ``k``
    sub-groups) for ``est`` (an estimate with every sub-group offloaded); None without figures to choose with
    (the caller keeps the longest run, as one INFO line says)."""
    figures = split_figures()
    fallback = (f"the longest run of first sub-groups within {BUDGET_KEY} ({len(device_numels) - 1}) rests on the "
                f"device")
    if figures is None:
        logger.info("optimizer split: no machine figures cached (`infinity bench --machine` measures them): %s",
                    fallback)
        return None
    try:
        predictions = [_predict(est, config, figures, count, numel, shape=shape, crossings=crossings)
                       for count, numel in enumerate(device_numels)]
    except ValueError as err:  # a path the figures lack (no disk measured, say)
        logger.info("optimizer split: the step-time model cannot predict this run (%s): %s", err, fallback)
        return None
    count = choose_count([p.predicted_s for p in predictions])
    choice = SplitChoice(count, tuple(p.predicted_s for p in predictions), predictions[count].bound_by)
    logger.info("optimizer split: %s", choice.describe())
    return choice


def _predict(est: dict, config: InfinityConfig, figures, count: int, device_numel: int, *, shape: StepShape | None,
             crossings: bool) -> StepPrediction:
    moved = move_to_device(copy.deepcopy(est), config, count, device_numel)
    traffic = traffic_from_estimate(
        moved, micro_batch=shape.micro_batch if shape else None, seq_len=shape.seq_len if shape else None,
        shape=shape.traffic_shape() if shape else None, crossings=crossings,
        recompute=shape.recompute if shape else None, overlap_step_with_backward=config.zero.overlap_step_with_backward,
        overlap_step_with_forward=config.zero.overlap_step_with_forward)
    return predict_step(figures, traffic)


def apply_optimizer_split(est: dict, config: InfinityConfig, *, shape: StepShape | None = None) -> dict:
    """``est`` (an estimate of the offloaded tier for every sub-group) with the split applied, in place:
    ``optimizer_split`` says the count, how it was chosen and, for ``auto`` with figures, the predicted step of
    the chosen count against every sub-group offloaded."""
    numels = est["sub_group_numels"]
    fitting = device_sub_group_count(config, numels, grad_itemsize=grad_itemsize_of(est), gpu=est["setting"]["gpu"],
                                     working_set_nbytes=sum(est["tiers"]["device"].values()))
    starts = [sum(numels[:k]) for k in range(fitting + 1)]
    auto = config.zero.offload_optimizer.device is OffloadDevice.AUTO
    choice = None
    if auto and fitting:
        choice = choose_split(est, config, starts, shape=shape, crossings=bool(est["setting"]["gpu"]))
    count = choice.device_sub_groups if choice is not None else fitting
    move_to_device(est, config, count, starts[count])
    split = est["optimizer_split"]
    if choice is not None:
        split.update(choice.as_dict())
    else:
        split.update(chosen_by=BUDGET_KEY if auto else "offload_optimizer.ratio", fitting_sub_groups=fitting)
    return est
