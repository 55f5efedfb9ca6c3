"""What ``save_model()`` writes: the whole model in the Hugging Face layout, or a ``peft`` model's adapters.

The whole model is written tensor by tensor by :meth:`Engine.save_pretrained`. A ``peft`` model's base is
frozen and was never trained, so only its trainable parameters (the adapters) are gathered from the
shards, and ``peft``'s own ``save_pretrained`` writes them (``adapter_config.json`` and
``adapter_model.safetensors``, names as ``peft`` writes them), which ``PeftModel.from_pretrained`` loads.
Both are collective: every rank calls them, rank 0 writes.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from infinity.checkpoint.state_dict import FullParamGatherer
from infinity.engine.engine import Engine
from infinity.weights.export import save_dtype

logger = logging.getLogger(__name__)


def save_full_model(engine: Engine, output_dir) -> dict:
    """The model in the Hugging Face layout (sharded safetensors, index, config), gathered tensor by tensor."""
    return engine.save_pretrained(output_dir)


def trainable_state_dict(engine: Engine) -> dict[str, torch.Tensor]:
    """The trainable parameters' full fp32 values under every name they have (collective: every rank calls it)."""
    source = engine.shard_source()
    gatherer = FullParamGatherer(source)
    try:
        by_index = {p.index: gatherer.gather(p).clone() for p in source.params if p.trainable}
    finally:
        gatherer.close()
    return {name: by_index[index] for name, index in source.param_names if index in by_index}


def save_adapters(engine: Engine, peft_model: nn.Module, output_dir, *, write: bool = True,
                  dtype: str = "fp32") -> tuple[int, int]:
    """``peft_model``'s adapters (its trainable parameters) written by peft into ``output_dir`` in ``dtype``
    (fp32, bf16, fp16); their count and bytes."""
    state = {name: value.to(save_dtype(dtype)) for name, value in trainable_state_dict(engine).items()}
    if write:
        peft_model.save_pretrained(str(output_dir), state_dict=state)
        logger.info("wrote %d adapter tensors to %s", len(state), output_dir)
    return len(state), sum(v.numel() * v.element_size() for v in state.values())
