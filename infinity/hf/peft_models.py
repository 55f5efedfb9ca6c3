"""``peft``, an optional extra, imported where a model is wrapped: one place that says how to install it, and that
wraps a model without the deprecation warnings ``peft`` raises from ``transformers``' own API (about calls ``peft``
makes, not the user's to act on)."""

from __future__ import annotations

import warnings

import torch

_PEFT_CALLS_DEPRECATED = r".*`is_gradient_checkpointing` is deprecated"
"""peft 0.21's get_peft_model asks transformers 5's models a question they have renamed."""


def require_peft(needed_for: str):
    """The ``peft`` module; ``ImportError`` naming ``needed_for`` and the extra to install where it is missing."""
    try:
        import peft
    except ImportError:
        raise ImportError(f"{needed_for} needs the `peft` package: pip install 'zero-infinity[hf]'") from None
    return peft


def wrap_with_peft(model: torch.nn.Module, peft_config, *, needed_for: str) -> torch.nn.Module:
    """``peft.get_peft_model(model, peft_config)``."""
    peft = require_peft(needed_for)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_PEFT_CALLS_DEPRECATED, category=FutureWarning)
        return peft.get_peft_model(model, peft_config)
