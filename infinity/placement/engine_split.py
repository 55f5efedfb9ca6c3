"""The engine's split optimizer, decided at ``initialize``: which of its layout's first sub-groups rest on the
device (:func:`~infinity.placement.optimizer_split.decide_split`), ``auto``'s count chosen by the step-time model
(:mod:`infinity.placement.split_choice`) over an estimate of the engine's own parameters and config."""

from __future__ import annotations

import torch

from infinity.config.schema import InfinityConfig
from infinity.placement.estimate import estimate, estimate_settings
from infinity.placement.layout import ShardLayout
from infinity.placement.optimizer_split import OptimizerSplit, decide_split, device_working_set_nbytes
from infinity.placement.split_choice import SplitChoice, StepShape, choose_split, step_shape_of

__all__ = ["engine_split"]


def engine_split(config: InfinityConfig, layout: ShardLayout, device: torch.device, *, distinct: bool, model,
                 step_shape: StepShape | None = None) -> OptimizerSplit:
    """The split for the engine's ``layout`` on ``device`` (``distinct``: device memory apart from host memory).
    ``step_shape``: the run's model shape and micro-batch for the step-time model (default: the model's own
    shape and sequence, ``train_micro_batch_size_per_gpu`` samples)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[config.precision]
    itemsize = torch.empty((), dtype=dtype).element_size()
    lossless = config.gradient_accumulation_steps == 1 and config.precision != "fp16"
    shape = step_shape or step_shape_of(model, micro_batch=config.micro_batch_size or 1)

    def choose(device_numels: list[int]) -> SplitChoice | None:
        est = estimate(param_numels=[s.numel for s in layout.slots],
                       trainable_params=sum(s.numel for s in layout.slots if s.trainable),
                       param_decays=[s.weight_decay for s in layout.slots],
                       **estimate_settings(config, world_size=layout.world_size, gpu=distinct))
        # The layout's flat space pads every shard to an alignment the estimate's element counts leave out: each
        # count's device elements are taken as the same share of the estimate's trainable elements.
        scale = sum(est["sub_group_numels"]) / layout.trainable_numel if layout.trainable_numel else 0.0
        return choose_split(est, config, [round(n * scale) for n in device_numels], shape=shape,
                            crossings=distinct)

    return decide_split(config, layout, device, grad_itemsize=itemsize if lossless else 4,
                        working_set_nbytes=device_working_set_nbytes(config, layout, itemsize), choose=choose)
