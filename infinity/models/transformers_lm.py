"""Hugging Face ``transformers`` causal LMs as the engine runs them: unwrapped, with their own forward.

The engine calls a transformers model (or a ``peft`` model around one) exactly as its user would:
``engine(input_ids=ids, attention_mask=mask, labels=ids)`` returns the model's ``ModelOutput``
(``.loss``, ``.logits``), positional arguments included. The only call refused is the byte GPT's
``engine(input_ids, targets)``: for a transformers model the second positional argument is
``attention_mask``, so the targets would be taken as a mask and the model would train on no labels at
all (:func:`refuse_targets_as_mask`).

``transformers`` is an optional extra (``pip install 'zero-infinity[hf]'``): nothing here imports it at
the top; it is recognised by its class names.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

_HF_BASES = ("PreTrainedModel", "PeftModel")
"""Base classes (by name, from the ``transformers`` and ``peft`` packages) that mark a Hugging Face model."""

OLD_CALL_HINT = ("a transformers model takes its own forward's arguments: call "
                 "engine(input_ids=ids, attention_mask=mask, labels=ids) and read .loss (labels are the input ids, "
                 "the model shifts them; -100 marks positions without a loss)")


def is_transformers_model(module: nn.Module) -> bool:
    """True for a ``transformers`` ``PreTrainedModel`` or a ``peft`` model (by the classes it derives from)."""
    for cls in type(module).__mro__:
        if cls.__name__ in _HF_BASES and cls.__module__.split(".")[0] in ("transformers", "peft"):
            return True
    return False


def refuse_targets_as_mask(args: tuple) -> None:
    """Refuse ``engine(input_ids, targets)`` for a transformers model, whose second positional is the mask.

    A real mask holds only 0 and 1 (or is boolean or floating, an additive mask); shifted token ids do
    not. The check reads the tensor's values, which waits for it on an accelerator: it runs only when a
    caller passes a second positional argument, which Hugging Face code does not.
    """
    if len(args) < 2 or not isinstance(args[1], torch.Tensor):
        return
    mask = args[1]
    if mask.is_floating_point() or mask.dtype == torch.bool or mask.numel() == 0:
        return
    if bool(((mask != 0) & (mask != 1)).any()):  # synchronizes: the values decide whether the call is refused
        raise ValueError(f"engine(input_ids, targets) is the byte GPT's call; the second positional argument of a "
                         f"transformers model is attention_mask and this one holds token ids. {OLD_CALL_HINT}")


def causal_lm_loss(engine, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean loss of one ``(input_ids, targets)`` batch of the CLI's corpora, for any model the CLI trains.

    Our GPT and a user's ``build_model()`` take ``(input_ids, targets)``; a transformers model takes
    ``labels=input_ids`` and shifts them itself (so the last target of each row has no prediction).
    """
    if is_transformers_model(engine.module):
        return engine(input_ids=input_ids, labels=input_ids).loss
    return engine(input_ids, targets)


def transformers_lm_from_config_file(path: Path) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` of the config JSON at ``path``, whose vocabulary must hold bytes."""
    try:
        json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"model config {str(path)!r} is not valid JSON: {err}") from None
    try:
        import transformers  # optional extra
    except ImportError:
        raise ValueError(
            f"model config {str(path)!r} is a Hugging Face config, but the `transformers` package is not "
            "installed (pip install transformers)"
        ) from None
    config = transformers.AutoConfig.from_pretrained(str(path))
    if getattr(config, "vocab_size", 256) < 256:
        raise ValueError(f"model config {str(path)!r}: vocab_size={config.vocab_size} < 256 cannot hold byte ids")
    return transformers.AutoModelForCausalLM.from_config(config)
