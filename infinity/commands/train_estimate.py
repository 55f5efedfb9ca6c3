"""The estimate of an ``infinity train`` run (bytes per rank in each tier), from its plan and the model or preset,
made before any work from the engine's config the plan holds."""

from __future__ import annotations

from infinity.models.gpt import GPT, GPTConfig, largest_module_params, param_numels
from infinity.placement.estimate import estimate, gpt_activation_nbytes
from infinity.placement.host_budget import resolve_host_budget
from infinity.placement.placement import distinct_device_requested

__all__ = ["estimate_for"]


def estimate_for(plan, model) -> dict:
    """The estimate for this run: ``model`` is a ``GPTConfig`` (not built) or an ``nn.Module``."""
    import torch

    cfg = plan.config
    zero = cfg.zero
    gpt_cfg = model if isinstance(model, GPTConfig) else (model.config if isinstance(model, GPT) else None)
    if isinstance(model, GPTConfig):
        numels, largest = param_numels(model), largest_module_params(model)
    else:
        numels = [p.numel() for p in model.parameters()]
        largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    activations = 0
    if gpt_cfg is not None:
        activations = gpt_activation_nbytes(gpt_cfg, micro_batch=plan.micro_batch, seq_len=plan.seq_len,
                                            precision=plan.precision)
    return estimate(
        param_numels=numels,
        world_size=plan.world_size,
        offload_param=plan.offload_param,
        offload_optimizer=plan.offload_optimizer,
        precision=cfg.precision,
        largest_layer_params=largest,
        max_live_parameters=zero.max_live_parameters,
        prefetch_bucket_size=zero.prefetch_bucket_size,
        max_reuse_distance=zero.max_reuse_distance,
        param_persistence_threshold=zero.param_persistence_threshold,
        sub_group_size=zero.sub_group_size,
        buffer_count=zero.offload_param.buffer_count,
        buffer_size=zero.offload_param.buffer_size,
        max_in_cpu=zero.offload_param.max_in_cpu,
        pipeline=zero.offload_optimizer.pipeline_read or zero.offload_optimizer.pipeline_write,
        optimizer_buffer_count=zero.offload_optimizer.buffer_count,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        gpu=torch.cuda.is_available() or distinct_device_requested(),  # device memory apart from host memory
        activation_nbytes=activations,
        host_memory_budget=resolve_host_budget(zero.host_memory_budget),
        optimizer_max_in_cpu=zero.offload_optimizer.max_in_cpu,
        overlap_step=zero.overlap_step_with_backward,
        step_undo=zero.overlap_step_with_backward and (cfg.gradient_clipping > 0 or cfg.precision == "fp16"),
        state_dtype=zero.offload_optimizer.state_dtype,
    )
