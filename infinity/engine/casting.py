"""What crosses into the engine's compute: the model's buffers and the forward's floating inputs, moved to the
compute device and cast to the compute precision."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map


def cast_buffers(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Every buffer of ``model`` on ``device``, floating ones in ``dtype``; a buffer left on the meta device is
    refused by name."""
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is None:
                continue
            if buf.is_meta:
                raise ValueError(f"buffer {name!r} of {type(module).__name__} is on the meta device; "
                                 f"give it a value in reset_parameters() or build it on a real device")
            converted = buf.to(device)
            if converted.is_floating_point():
                converted = converted.to(dtype)
            module._buffers[name] = converted


def cast_floating(tree, dtype: torch.dtype, device: torch.device):
    """``tree`` (the forward's arguments) with every tensor on ``device`` and every floating one in ``dtype``."""

    def cast(x):
        if isinstance(x, torch.Tensor):
            x = x.to(device, non_blocking=True)
            if x.is_floating_point() and x.dtype != dtype:
                x = x.to(dtype)
        return x
    return tree_map(cast, tree)
