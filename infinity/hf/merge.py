"""A ``peft`` LoRA model written as its base with the adapters merged in: one Hugging Face model folder.

:func:`save_merged` writes what ``peft_model.merge_and_unload().save_pretrained(out_dir)`` would, without the
model whole in memory: the adapters (small) are gathered first; each LoRA layer's delta is ``peft``'s own
``get_delta_weight`` over them (its scaling, ``fan_in_fan_out``, embeddings); then each base tensor is
gathered from the ranks' shards, its layer's delta added, and written before the next. Names are the base
model's (``base_model.model.``, ``base_layer`` dropped); a ``modules_to_save`` layer is written from its
trained copy (where its original is tied to another layer, that one keeps the original, untied, as peft leaves it).
``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it, with no ``peft`` needed.

Collective: every rank calls it, rank 0 writes. The LoRA variants whose merge is not a delta added to the
weight (DoRA's magnitudes), and ``trainable_token_indices`` (rows written over the embeddings), are refused before
anything is gathered.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from infinity.checkpoint.shard_source import require_step_boundary
from infinity.checkpoint.state_dict import FullParamGatherer
from infinity.engine.engine import Engine
from infinity.engine.stand_ins import stand_ins_for
from infinity.weights.adapters import (ADAPTER_PARTS, ORIGINAL_PART, adapter_of_saved_copy, base_tensor_name,
                                       is_adapter, is_peft_model)
from infinity.weights.export import (DEFAULT_MAX_SHARD_NBYTES, HFTensor, generation_config_json, hf_config_of,
                                     save_dtype, write_hf_folder)

logger = logging.getLogger(__name__)


def save_merged(engine: Engine, peft_model: nn.Module, out_dir, *, dtype: str = "fp32",
                max_shard_nbytes: int = DEFAULT_MAX_SHARD_NBYTES) -> dict:
    """``peft_model`` (the engine's model) with its active LoRA adapters merged, in the Hugging Face layout."""
    if not is_peft_model(peft_model):
        raise ValueError(f"save_merged needs a peft model (get_peft_model(...)), got {type(peft_model).__name__}")
    layers = _lora_layers(peft_model)
    source = engine.shard_source()
    require_step_boundary(source, "save_merged")
    out_dtype = save_dtype(dtype)
    first_name, names_of = {}, {}
    for name, index in source.param_names:
        first_name.setdefault(index, name)
        names_of.setdefault(index, []).append(name)
    gatherer = FullParamGatherer(source)
    try:
        # the adapters first, all of them (they are small): every rank gathers the same ones in the same order
        adapters = {first_name[p.index]: gatherer.gather(p).clone() for p in source.params
                    if is_adapter(first_name[p.index])}
        deltas = _deltas(peft_model, layers, adapters)
        active = set(peft_model.active_adapters)
        copies = {base_tensor_name(first_name[p.index]) for p in source.params
                  if adapter_of_saved_copy(first_name[p.index]) in active}
        tensors, untied = [], False
        for p in source.params:
            name = first_name[p.index]
            if is_adapter(name) or adapter_of_saved_copy(name) not in (None, *active):
                continue  # merged in; or another adapter's modules_to_save copy, which peft's merge drops too
            # A modules_to_save layer's untrained original is written from its copy; where it is tied (GPT-2's
            # lm_head to wte), the other name keeps the original, and the merged model's embeddings are untied,
            # as peft's merge_and_unload leaves them.
            names = names_of[p.index]
            if any(f".{ORIGINAL_PART}." in n and base_tensor_name(n) in copies for n in names):
                kept = [n for n in names if base_tensor_name(n) not in copies]
                if not kept:
                    continue
                untied, name = True, kept[0]
            delta = deltas.get(name)
            tensors.append(HFTensor(base_tensor_name(name), p.shape, out_dtype,
                                    lambda out, p=p, d=delta: out.copy_(gatherer.gather(p) if d is None
                                                                        else gatherer.gather(p) + d)))
        written = {t.name for t in tensors}
        for buf in source.buffers():
            key = base_tensor_name(buf.name)
            if buf.persistent and key not in written:
                written.add(key)
                kind = out_dtype if buf.tensor.is_floating_point() else buf.tensor.dtype
                tensors.append(HFTensor(key, tuple(buf.tensor.shape), kind,
                                        lambda out, b=buf.tensor: out.copy_(b.detach().cpu())))
        extra = generation_config_json(peft_model)
        config = hf_config_of(peft_model, out_dtype)
        if untied and config is not None:
            config["tie_word_embeddings"] = False
        summary = write_hf_folder(out_dir, tensors, config=config, extra_files=extra,
                                  max_shard_nbytes=max_shard_nbytes, write=source.comm.rank == 0)
    finally:
        gatherer.close()
    if source.comm.rank == 0:
        logger.info("wrote %s: the base with %d LoRA layer(s) merged", out_dir, len(layers))
    return dict(summary, merged_layers=len(layers))


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's LoRA layers by name; a variant whose merge is not a delta (DoRA) is refused by name."""
    layers = {}
    for name, module in model.named_modules():
        if hasattr(module, "trainable_tokens_delta"):  # peft's TrainableTokensLayer: its merge replaces rows
            raise ValueError(f"layer {name!r} holds peft's trainable_token_indices, whose merge writes its tokens' "
                             f"rows over the embeddings' (not a delta added to them); save the adapters instead "
                             f"(--save-pretrained without --merge-lora)")
        if not (callable(getattr(module, "get_delta_weight", None)) and hasattr(module, "lora_A")):
            continue
        variants = getattr(module, "lora_variant", None) or {}
        if variants or any(getattr(module, "use_dora", {}).values()):
            raise ValueError(f"LoRA layer {name!r} uses a variant (DoRA) whose merge is not a delta on its weight; "
                             f"save the adapters instead (--save-pretrained without --merge-lora)")
        layers[name] = module
    return layers


def _deltas(model: nn.Module, layers: dict[str, nn.Module], adapters: dict[str, torch.Tensor]
            ) -> dict[str, torch.Tensor]:
    """Each wrapped base parameter's delta (by its name in ``model``): its layer's active adapters, as ``peft``
    merges them (``get_delta_weight``; ``lora_bias``: ``lora_B.bias`` x scaling on the base bias)."""
    values = {id(p): adapters[name] for name, p in model.named_parameters() if name in adapters}  # shaped already
    deltas: dict[str, torch.Tensor] = {}
    for layer_name, layer in layers.items():
        holders = [m for part in ADAPTER_PARTS if isinstance(getattr(layer, part, None), nn.Module)
                   for m in getattr(layer, part).modules()]
        active = [a for a in layer.active_adapters if a in layer.lora_A or a in getattr(layer, "lora_embedding_A", {})]
        with stand_ins_for(holders, values):
            for adapter in active:
                _add(deltas, f"{layer_name}.base_layer.weight", layer.get_delta_weight(adapter).float())
                if getattr(layer, "lora_bias", {}).get(adapter):
                    _add(deltas, f"{layer_name}.base_layer.bias",
                         (layer.lora_B[adapter].bias * layer.scaling[adapter]).float())
    return deltas


def _add(deltas: dict[str, torch.Tensor], name: str, delta: torch.Tensor) -> None:
    deltas[name] = delta.detach().clone() if name not in deltas else deltas[name] + delta.detach()
