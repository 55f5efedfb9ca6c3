"""Gathering the full, fp32 state dict under the original names."""

from __future__ import annotations

import torch


def gather_full_state_dict(engine) -> dict[str, torch.Tensor]:
    """fp32 masters (trainable) or compute shards (frozen), gathered over ranks, trimmed and reshaped; host tensors.

    Every name a parameter is registered under (tied parameters have several)
    gets an entry, and buffers are included, so ``load_state_dict`` of the
    plain model accepts the result. With tiling, names and shapes are the
    untiled ones.
    """
    layout, comm = engine.layout, engine.comm
    masters: dict[int, torch.Tensor] = {}
    for group in layout.sub_groups:
        values = torch.empty(group.numel, dtype=torch.float32)
        engine.optimizer.read_master(group, values)
        for slot in group.slots:
            start = slot.offset - group.start
            masters[slot.index] = values[start:start + slot.shard_numel].clone()
    by_id = {}
    for sharded in engine.params:
        slot = sharded.slot
        if slot.index in masters:
            shard = masters[slot.index]
        else:
            shard = torch.empty(slot.shard_numel, dtype=engine.dtype)
            engine.compute.read_to_host(slot, shard)
            shard = shard.float()
        full = torch.empty(slot.padded_numel, dtype=torch.float32)
        comm.all_gather_into(full, shard)
        by_id[id(sharded.param)] = full[:slot.numel].view(slot.shape).clone()
    out: dict[str, torch.Tensor] = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        out[name] = by_id[id(param)]
    for module_name, module in engine.module.named_modules():
        for local, buf in module.named_buffers(recurse=False):
            if buf is None or local in module._non_persistent_buffers_set:
                continue  # like state_dict(): non-persistent buffers are not part of the state
            name = f"{module_name}.{local}" if module_name else local
            value = buf.detach().cpu()  # a state dict is host tensors, wherever the engine computes
            out[name] = value.float().clone() if value.is_floating_point() else value.clone()
    plan = getattr(engine, "tiling_plan", None)
    if plan is not None and not plan.is_empty:
        out = plan.untile_state_dict(out)
    return out
