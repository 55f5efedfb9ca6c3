"""A ``peft`` model's parameters against its base model's files: which tensor each reads, which are new.

``get_peft_model(model, LoraConfig(...))`` renames what it wraps: the base model sits under
``base_model.model.``, a wrapped layer's own weight under ``<layer>.base_layer.``, and a
``modules_to_save`` layer twice (``<layer>.original_module.`` and ``<layer>.modules_to_save.<adapter>.``),
both copies of the same tensor in the base model's files. The LoRA adapters (``lora_A``, ``lora_B``,
``lora_embedding_A``, ``lora_embedding_B``) are in no file: they are new, and initialized as ``peft``
initializes them (:mod:`infinity.engine.adapter_init`).

So a model built on the meta device, wrapped by ``peft``, streams its base from the base model's folder
(``initialize(peft_model, config, weights=folder)``) and is never whole in memory. What such a run saves of it
is the adapters (:func:`save_adapters`), written by ``peft`` itself, which ``PeftModel.from_pretrained`` loads.
``peft`` itself is imported only where a peft model is at hand (:func:`kept_entries`): its models are known by their
classes' names, as :mod:`infinity.models.transformers_lm` does.
"""

from __future__ import annotations

import logging

import torch

from infinity.checkpoint.shard_source import ShardSource
from infinity.checkpoint.state_dict import FullParamGatherer
from infinity.weights.export import save_dtype

logger = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
"""Where ``PeftModel`` keeps the model it wraps (``PeftModel.base_model`` is the tuner, its ``model`` the base)."""

ORIGINAL_PART = "original_module"
"""``<layer>.original_module.``: a ``modules_to_save`` layer's own, untrained tensors."""
WRAPPER_PARTS = frozenset({"base_layer", ORIGINAL_PART})
"""Name parts a ``peft`` wrapper inserts before the wrapped layer's own tensors."""

SAVED_COPY_PART = "modules_to_save"
"""``<layer>.modules_to_save.<adapter>.``: a trainable copy of the base layer, read from the base's tensors."""

ADAPTER_PARTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"})
"""Name parts of the LoRA adapters' own parameters: in no base model's files."""
DRAWN_VALUES = "infinity_drawn_values"
"""The attribute of an adapter module holding its new parameters' values by name (fp32, on the host) where ``peft``
drew them before moving them to their base layer's meta device; the engine starts from them in place of drawing."""


def is_peft_model(model: torch.nn.Module) -> bool:
    """True for a ``peft`` ``PeftModel`` (by the classes it derives from; ``peft`` is not imported)."""
    return any(cls.__name__ == "PeftModel" and cls.__module__.split(".")[0] == "peft" for cls in type(model).__mro__)


def adapter_config_record(model: torch.nn.Module) -> dict:
    """A ``peft`` model's active adapter config as ``peft`` writes it into ``adapter_config.json`` (its sets as sorted
    lists): what a checkpoint without the base records, so that ``infinity consolidate --hf`` writes the adapters
    from the checkpoint alone (``peft.PeftConfig.from_peft_type(**record)`` builds it again)."""
    record = model.peft_config[model.active_adapter].to_dict()
    return {key: sorted(value) if isinstance(value, set) else value for key, value in record.items()}


def is_adapter(name: str) -> bool:
    """True for a LoRA adapter's parameter of a ``peft`` model (``...q_proj.lora_A.default.weight``)."""
    return any(part in ADAPTER_PARTS for part in name.split("."))


def base_tensor_name(name: str) -> str:
    """The base model's tensor a ``peft`` model's parameter or buffer ``name`` holds (not an adapter's)."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    parts = name.split(".")
    kept: list[str] = []
    i = 0
    while i < len(parts):
        if parts[i] in WRAPPER_PARTS:
            i += 1
        elif parts[i] == SAVED_COPY_PART and i + 1 < len(parts):
            i += 2  # the part after it is the adapter's name
        else:
            kept.append(parts[i])
            i += 1
    return ".".join(kept)


def original_of_saved_copy(name: str) -> str | None:
    """The wrapped layer's own parameter (``<layer>.original_module.<rest>``) that a ``modules_to_save`` copy
    (``<layer>.modules_to_save.<adapter>.<rest>``) was copied from; None for any other name. The copy is read from
    that parameter's tensor, under any of its names: with tied embeddings a saved ``lm_head``'s copy is the
    embeddings', and the files hold that tensor under the embeddings' name alone."""
    parts = name.split(".")
    at = _saved_copy_at(parts)
    return None if at is None else ".".join(parts[:at] + [ORIGINAL_PART] + parts[at + 2:])


def adapter_of_saved_copy(name: str) -> str | None:
    """The adapter whose ``modules_to_save`` copy ``name`` is a parameter of (``<layer>.modules_to_save.<adapter>.``);
    None for any other name."""
    parts = name.split(".")
    at = _saved_copy_at(parts)
    return None if at is None else parts[at + 1]


def _saved_copy_at(parts: list[str]) -> int | None:
    """Where :data:`SAVED_COPY_PART` stands in a name's ``parts``, followed by an adapter and a tensor; or None."""
    return next((i for i, part in enumerate(parts[:-2]) if part == SAVED_COPY_PART), None)


def saved_state_dict(source: ShardSource, peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters ``peft_model.save_pretrained`` writes, full fp32 under every name they have (collective: every
    rank calls it): the trainable ones, and those peft's selection keeps that are frozen (the adapters not active
    now: peft writes every adapter, each in its own folder; the embedding layers where the config asks for them)."""
    kept = kept_entries(peft_model, None, "auto")
    kept_names = set(kept) if kept is not None else set()
    kept_indices = {index for name, index in source.param_names if name in kept_names}
    gatherer = FullParamGatherer(source)
    try:
        by_index = {p.index: gatherer.gather(p).clone() for p in source.params
                    if p.trainable or p.index in kept_indices}
    finally:
        gatherer.close()
    return {name: by_index[index] for name, index in source.param_names if index in by_index}


def kept_entries(peft_model: torch.nn.Module, adapters, save_embedding_layers) -> dict[str, torch.Tensor] | None:
    """The entries of ``peft_model``'s state dict that its ``save_pretrained`` keeps for ``adapters`` (None: all of
    its adapters), as the parameters and buffers themselves; None where peft's selection made new tensors of them
    or failed (the caller then reads the whole state dict, or the trainable parameters alone)."""
    from peft.utils import get_peft_model_state_dict  # a peft model is at hand: peft is installed

    entries = peft_model.state_dict(keep_vars=True)  # the parameters themselves: nothing is read
    keys_by_id: dict[int, list[str]] = {}
    for key, value in entries.items():
        keys_by_id.setdefault(id(value), []).append(key)
    kept = {}
    for adapter in list(adapters) if adapters is not None else list(peft_model.peft_config):
        try:
            selected = get_peft_model_state_dict(peft_model, state_dict=entries, adapter_name=adapter,
                                                 save_embedding_layers=save_embedding_layers)
        except Exception as err:  # noqa: BLE001  (any selection this cannot follow is left to peft whole)
            logger.debug("peft's selection of adapter %r not followed (%r)", adapter, err)
            return None
        for value in selected.values():
            keys = keys_by_id.get(id(value))
            if keys is None:
                return None  # a new tensor: which entries it came from is not known here
            kept.update((key, entries[key]) for key in keys)
    return kept


def save_adapters(source: ShardSource, peft_model: torch.nn.Module, out_dir, *, dtype: str = "fp32",
                  write: bool = True) -> tuple[int, int]:
    """``peft_model``'s adapters (every one of them: :func:`saved_state_dict`) written by ``peft`` into ``out_dir`` in
    ``dtype`` (``adapter_config.json``, ``adapter_model.safetensors``, another adapter's in its own folder); their
    count and bytes. Collective: every rank calls it, those with ``write`` write."""
    state = {name: value.to(save_dtype(dtype)) for name, value in saved_state_dict(source, peft_model).items()}
    if write:
        peft_model.save_pretrained(str(out_dir), state_dict=state)
        logger.info("wrote %d adapter tensors to %s", len(state), out_dir)
    return len(state), sum(v.numel() * v.element_size() for v in state.values())
