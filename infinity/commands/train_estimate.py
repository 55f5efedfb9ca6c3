"""The estimate of an ``infinity train`` run (bytes per rank in each tier), from its plan and the model or preset,
made before any work from the engine's config the plan holds (:func:`~infinity.placement.estimate.estimate_for_config`,
which ``infinity estimate`` uses too, so the two agree to the byte)."""

from __future__ import annotations

import torch

from infinity.models.gpt import GPT, GPTConfig, largest_module_params, param_numels, param_shapes
from infinity.optim.param_groups import decay_matrices_only, decays_ndim
from infinity.placement.estimate import estimate_for_config
from infinity.placement.estimate_gpt import gpt_activation_nbytes
from infinity.placement.placement import distinct_device_requested
from infinity.placement.split_choice import StepShape, recomputes, step_shape_of

__all__ = ["device_memory_apart", "estimate_for", "model_decays", "model_numels", "model_trainable",
           "run_step_shape"]


def model_numels(model) -> tuple[list[int], int]:
    """(each parameter's numel in order, the largest module's own parameters) of a ``GPTConfig`` (not built) or an
    ``nn.Module`` (on the meta device or not)."""
    if isinstance(model, GPTConfig):
        return param_numels(model), largest_module_params(model)
    numels = [p.numel() for p in model.parameters()]
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return numels, largest


def model_decays(model, weight_decay: float) -> list[float | None]:
    """Each parameter's weight decay as ``infinity train`` gives it (:func:`decay_matrices_only`), in the order of
    :func:`model_numels`, for a ``GPTConfig`` (from its shapes, not built) or an ``nn.Module``; None for a frozen
    one. The layout lays each decay's parameters together, and the estimate follows it."""
    if isinstance(model, GPTConfig):  # from the shapes alone: building even a meta model costs ~75 MiB (gpt.py)
        return [weight_decay if decays_ndim(len(shape)) else 0.0 for shape in param_shapes(model)]
    decay_of = {id(p): group["weight_decay"] for group in decay_matrices_only(model, weight_decay)
                for p in group["params"]}
    return [decay_of.get(id(p)) for p in model.parameters()]


def model_trainable(model) -> list[bool] | None:
    """Whether each parameter trains, in the order of :func:`model_numels`; None when all do (a ``GPTConfig``, or
    a model with nothing frozen)."""
    if isinstance(model, GPTConfig):
        return None
    trains = [p.requires_grad for p in model.parameters()]
    return None if all(trains) else trains


def run_step_shape(plan, model) -> StepShape | None:
    """The run's model shape, micro-batch and recompute for the step-time model (the estimate's and the engine's
    alike, so that both choose the same split)."""
    return step_shape_of(model, micro_batch=plan.micro_batch, seq_len=plan.seq_len,
                         recompute=plan.activation_checkpointing or recomputes(model))


def device_memory_apart() -> bool:
    """Whether this machine's run computes on a device whose memory is apart from the host's: a GPU, or the test
    mode that keeps them apart (``INFINITY_DISTINCT_DEVICE=1``)."""
    return torch.cuda.is_available() or distinct_device_requested()


def estimate_for(plan, model) -> dict:
    """The estimate for this run: ``model`` is a ``GPTConfig`` (not built) or an ``nn.Module``."""
    gpt_cfg = model if isinstance(model, GPTConfig) else (model.config if isinstance(model, GPT) else None)
    numels, largest = model_numels(model)
    activations = 0
    if gpt_cfg is not None:
        activations = gpt_activation_nbytes(gpt_cfg, micro_batch=plan.micro_batch, seq_len=plan.seq_len,
                                            precision=plan.precision,
                                            activation_checkpointing=plan.activation_checkpointing)
    result = estimate_for_config(plan.config, param_numels=numels, largest_layer_params=largest,
                                 world_size=plan.world_size,
                                 gpu=device_memory_apart(),
                                 activation_nbytes=activations, step_shape=run_step_shape(plan, model),
                                 param_decays=model_decays(model, plan.config.optimizer.weight_decay),
                                 param_trainable=model_trainable(model))
    result["setting"]["activation_checkpointing"] = plan.activation_checkpointing  # the step-time model's recompute
    return result
