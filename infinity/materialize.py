"""Initial values of parameters, one module at a time.

A model built under ``torch.device("meta")`` (or :func:`infinity.Init`) has
shapes but no values: each module that owns parameters is given real storage
for its own parameters only and its ``reset_parameters()`` is called, so host
memory holds one module's values at a time, never the whole model's.
"""

from __future__ import annotations


import torch

from infinity.layout import ParamSlot


def Init():
    """Build a model inside this context and it stays shapes-only until ``initialize`` shards it."""
    return torch.device("meta")


def materialize_module(module: torch.nn.Module, module_name: str,
                       todo: list[tuple[str, torch.nn.Parameter]],
                       original_data: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """The full fp32 values of ``todo`` (this module's parameters not yet sharded)."""
    if not any(original_data[id(p)].is_meta for _, p in todo):
        return [original_data[id(p)].detach().float() for _, p in todo]
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise ValueError(
            f"module {module_name or type(module).__name__!r} ({type(module).__name__}) has parameters on the meta "
            f"device but no reset_parameters() to initialize them; define it or build the model on a real device")
    # reset_parameters() initializes every direct parameter of the module: give each a
    # stand-in with real storage (parameters already sharded get a throwaway one).
    stand_ins = {}
    for local_name, param in list(module._parameters.items()):
        if param is None:
            continue
        source = original_data.get(id(param))
        shape = param.shape
        stand_ins[local_name] = (param, torch.nn.Parameter(
            torch.empty(shape, dtype=torch.float32) if source is None or source.is_meta else source.detach().float().clone(),
            requires_grad=param.requires_grad))
    try:
        for local_name, (_, stand_in) in stand_ins.items():
            module._parameters[local_name] = stand_in
        with torch.no_grad():
            reset()
        by_param = {id(orig): stand_in for orig, stand_in in stand_ins.values()}
        return [by_param[id(p)].detach() for _, p in todo]
    finally:
        for local_name, (orig, _) in stand_ins.items():
            module._parameters[local_name] = orig


def shard_values(full: torch.Tensor, slot: ParamSlot, rank: int) -> torch.Tensor:
    """This rank's slice of a full tensor, flattened and zero-padded, in fp32."""
    flat = full.reshape(-1).float()
    start = rank * slot.shard_numel
    shard = torch.zeros(slot.shard_numel, dtype=torch.float32)
    valid = max(0, min(slot.numel - start, slot.shard_numel))
    if valid:
        shard[:valid].copy_(flat[start:start + valid])
    return shard


def replace_meta_parameters(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """Swap each meta parameter for a real (empty) one in every module that registers it, so tying holds.

    Returns, by the new parameter's id, the meta tensor it replaces (its shape
    and the signal that values must come from ``reset_parameters``).
    """
    replaced: dict[int, torch.nn.Parameter] = {}
    meta_of: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for local_name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in replaced:
                # the right shape, no bytes: the engine gives it storage when it is fetched
                real = torch.empty(param.shape, dtype=param.dtype)
                real.untyped_storage().resize_(0)
                new = torch.nn.Parameter(real, requires_grad=param.requires_grad)
                replaced[id(param)] = new
                meta_of[id(new)] = param.data
            module._parameters[local_name] = replaced[id(param)]
    return meta_of
