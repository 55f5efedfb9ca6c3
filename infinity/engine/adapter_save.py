"""A ``peft`` model's own ``save_pretrained(dir)`` on a model the engine partitions reads whole only what it writes.

peft's ``save_pretrained`` takes ``model.state_dict()`` and keeps the entries its config asks for (the adapters, and
biases, ``modules_to_save`` or embedding layers where the config says so). Each released entry of that state dict is
read whole (:mod:`infinity.engine.model_state`), so the frozen base would be gathered into host memory only to be
dropped: a base larger than host memory could not be saved at all. Here, where the call passes no ``state_dict``,
peft's own selection (``get_peft_model_state_dict``) first runs over the parameters themselves
(``state_dict(keep_vars=True)``: no value is read), which names the entries it keeps; only those are read whole, and
peft is given them as the state dict. A selection that makes new tensors of the entries it keeps (none of LoRA's does)
is not followed: the whole state dict is read then, as without this.

With several ranks ``model.state_dict()`` is refused, naming the collective forms (``engine.save_pretrained(dir)``
writes the adapters without gathering the base); the call is left to it.
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch

from infinity.weights.adapters import kept_entries

logger = logging.getLogger(__name__)


class AdapterSaveHook:
    """``save_pretrained`` of a ``peft`` model, wrapped on the instance to pass peft the entries it keeps, whole."""

    def __init__(self, owner, peft_model: torch.nn.Module, managed):
        """``managed``: the ids of the parameters the engine partitions (a container of them)."""
        self._owner = weakref.ref(owner)  # the model does not keep a closed-over engine alive
        self._model = weakref.ref(peft_model)
        self._managed = frozenset(managed)  # the ids alone: the model's method must not keep the engine's parts alive
        original = peft_model.save_pretrained
        peft_model.__dict__["save_pretrained"] = functools.wraps(original)(self._saving(original))

    def _saving(self, original):
        def save_pretrained(save_directory, *args, **kwargs):
            owner, model = self._owner(), self._model()
            if (owner is not None and model is not None and owner.world_size == 1 and not args
                    and kwargs.get("state_dict") is None):
                kept = kept_entries(model, kwargs.get("selected_adapters"), kwargs.get("save_embedding_layers", "auto"))
                if kept is not None:
                    kwargs["state_dict"] = self._whole(owner, kept)
            return original(save_directory, *args, **kwargs)
        return save_pretrained

    def _whole(self, owner, entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each entry's value as ``state_dict()`` gives it: a released parameter read whole (once, if tied)."""
        whole, read = owner.whole_params(), {}
        values = {}
        for key, value in entries.items():
            if id(value) in self._managed and value.numel() == 0:
                if id(value) not in read:
                    read[id(value)] = whole.read_as_computed(value)
                values[key] = read[id(value)]
            else:
                values[key] = value.detach()
        return values
