"""What ``save_model()`` writes: the whole model in the Hugging Face layout, or a ``peft`` model's adapters.

The whole model is written tensor by tensor by :meth:`Engine.save_pretrained`. A ``peft`` model's base is
frozen and was never trained, so only its trainable parameters (the adapters) are gathered from the
shards, and ``peft``'s own ``save_pretrained`` writes them (``adapter_config.json`` and
``adapter_model.safetensors``, names as ``peft`` writes them), which ``PeftModel.from_pretrained`` loads.
Both are collective: every rank calls them, rank 0 writes.
"""

from __future__ import annotations

from torch import nn

from infinity.engine.engine import Engine
from infinity.weights import adapters


def save_full_model(engine: Engine, output_dir) -> dict:
    """The model in the Hugging Face layout (sharded safetensors, index, config), gathered tensor by tensor."""
    return engine.save_pretrained(output_dir)


def save_adapters(engine: Engine, peft_model: nn.Module, output_dir, *, write: bool = True,
                  dtype: str = "fp32") -> tuple[int, int]:
    """``peft_model``'s adapters (its trainable parameters) written by peft into ``output_dir`` in ``dtype``
    (fp32, bf16, fp16); their count and bytes."""
    return adapters.save_adapters(engine.shard_source(), peft_model, output_dir, dtype=dtype, write=write)
