"""Parameters given real, temporary storage while an initializer writes them.

A module whose parameters have no values (built on the meta device; or, inside the engine, shards whose
full tensors are not gathered) is initialized by code that writes its parameters in place
(``reset_parameters()``, ``_init_weights(module)``, ``peft``'s ``reset_lora_parameters``). Each direct
parameter of the given modules is swapped for a stand-in for the duration: NaN where the parameter has no
values yet (so a value the initializer leaves unset shows), else a copy of its values. The originals are
put back on exit, and the stand-ins' fp32 values are left in the dict the context yields, by the original
parameter's id.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch


@contextlib.contextmanager
def stand_ins_for(modules: list[torch.nn.Module], original_data: dict[int, torch.Tensor] | None = None
                  ) -> Iterator[dict[int, torch.Tensor]]:
    """Swap every direct parameter of ``modules`` for a stand-in; on exit their values, by parameter id."""
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter, torch.nn.Parameter]] = []
    values: dict[int, torch.Tensor] = {}
    try:
        for module in modules:
            for local_name, param in list(module._parameters.items()):
                if param is None:
                    continue
                source = None if original_data is None else original_data.get(id(param))
                if source is None or source.is_meta:
                    value = torch.full(param.shape, math.nan, dtype=torch.float32)
                else:
                    value = source.detach().float().clone()
                stand_in = torch.nn.Parameter(value, requires_grad=param.requires_grad)
                module._parameters[local_name] = stand_in
                swapped.append((module, local_name, param, stand_in))
        with torch.no_grad():
            yield values
    finally:
        for module, local_name, original, _ in swapped:
            module._parameters[local_name] = original
    values.update({id(original): stand_in.detach() for _, _, original, stand_in in swapped})
