"""A ``peft`` model's LoRA adapters on a base streamed from its files: initialized as ``peft`` initializes them.

``get_peft_model`` on a model built on the meta device leaves its adapters on the meta device too, without
values. Each LoRA layer's adapters are given them here, one layer at a time, by the layer's own
``reset_lora_parameters(adapter, init_lora_weights)`` (``True``: ``lora_A`` Kaiming-uniform, ``lora_B``
zeros, so the model starts as its base; ``"gaussian"``: ``lora_A`` normal with std 1/r), or, for
``init_lora_weights=False``, by each adapter layer's own ``reset_parameters()`` as its constructor draws.
The draws come from the generator as :func:`write_initial_shards` seeds it (the same on every rank).

The initializations ``peft`` computes from the base's weights (PiSSA, OLoRA, LoftQ, EVA, CorDA, ...),
DoRA's magnitudes and ``trainable_token_indices``' rows need the base in memory: they are refused by
:func:`check_adapter_init`, naming the option, before any file is opened.
"""

from __future__ import annotations

import torch

from infinity.engine.stand_ins import stand_ins_for
from infinity.weights.adapters import ADAPTER_PARTS, is_peft_model

def check_adapter_init(model: torch.nn.Module) -> None:
    """Refuse, before any work, a ``peft`` model whose adapters cannot be initialized without its base in memory."""
    if not is_peft_model(model):
        return
    configs = getattr(model, "peft_config", None) or {}
    for adapter, config in configs.items():
        init = getattr(config, "init_lora_weights", True)
        if not (init is True or init is False or (isinstance(init, str) and init.lower() == "gaussian")):
            raise ValueError(f"peft adapter {adapter!r}: init_lora_weights={init!r} is computed from the base "
                             f"model's weights, which are streamed from their files here; use True or "
                             f"'gaussian', or build the model from its weights before get_peft_model")
        if getattr(config, "use_dora", False):
            raise ValueError(f"peft adapter {adapter!r}: use_dora=True computes its magnitudes from the base "
                             f"model's weights, which are streamed from their files here; use plain LoRA, or "
                             f"build the model from its weights before get_peft_model")
        tokens = getattr(config, "trainable_token_indices", None)
        if tokens:  # peft copies those rows of the embeddings into the new deltas (on meta: no values)
            raise ValueError(f"peft adapter {adapter!r}: trainable_token_indices={tokens!r} starts its tokens' rows "
                             f"from the base model's embeddings, which are streamed from their files here; build the "
                             f"model from its weights before get_peft_model, or leave the embeddings frozen")


class AdapterInit:
    """The initial values of a ``peft`` model's LoRA adapters, one LoRA layer at a time."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._modules = dict(model.named_modules())
        configs = getattr(model, "peft_config", None) or {}
        self._init_of = {adapter: getattr(config, "init_lora_weights", True) for adapter, config in configs.items()}
        self._values: dict[int, torch.Tensor] = {}  # by parameter id: drawn with its layer, not yet asked for

    def values(self, module_name: str, todo: list[tuple[str, torch.nn.Parameter]],
               original_data: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """The full fp32 values of ``todo`` (adapter parameters of the module ``module_name``)."""
        for local, param in todo:
            if id(param) not in self._values:
                self._draw_layer(_layer_name(f"{module_name}.{local}" if module_name else local), original_data)
        return [self._values.pop(id(param)) for _, param in todo]

    def _draw_layer(self, layer_name: str, original_data: dict[int, torch.Tensor]) -> None:
        """Every adapter of one LoRA layer, drawn in the order ``peft``'s ``update_layer`` draws them."""
        layer = self._modules[layer_name]
        holders = [module for part in ADAPTER_PARTS if isinstance(getattr(layer, part, None), torch.nn.Module)
                   for module in getattr(layer, part).modules()]
        with stand_ins_for(holders, original_data) as values:
            for adapter in _adapters_of(layer):
                init = self._init_of.get(adapter, True)
                if init is False:  # peft keeps what the adapter layers' constructors drew
                    for part in ("lora_A", "lora_B"):
                        container = getattr(layer, part, None)
                        if container is not None and adapter in container:
                            container[adapter].reset_parameters()
                else:
                    layer.reset_lora_parameters(adapter, init)
        self._values.update(values)


def _adapters_of(layer: torch.nn.Module) -> list[str]:
    names: list[str] = []
    for part in ADAPTER_PARTS:
        container = getattr(layer, part, None)
        if container is not None:
            names += [name for name in container.keys() if name not in names]
    return names


def _layer_name(param_name: str) -> str | None:
    """The LoRA layer a parameter of its adapters belongs to (the name before ``lora_A``, ...)."""
    parts = param_name.split(".")
    for i, part in enumerate(parts):
        if part in ADAPTER_PARTS:
            return ".".join(parts[:i])
    return None
