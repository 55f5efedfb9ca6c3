"""A ``peft`` model's ``merge_and_unload()``, ``merge_adapter()`` and ``unmerge_adapter()`` on a model the engine
partitions: each adapter layer merges (or takes back) its adapters with its parameters whole, and what it wrote
becomes their shards.

``peft`` merges a layer in its ``merge`` method: ``weight.data += B @ A * scaling``. Between passes a released
parameter's ``.data`` is empty, so the delta is an empty product and the merge adds nothing, without an error: the
"merged" model computes and saves as the base without its adapters (DeepSpeed's ZeRO-3 does the same). Here each
adapter layer's ``merge`` and ``unmerge`` run with that layer's parameters gathered (one layer at a time: the whole
model is never in memory at once), and on exit the values the layer wrote become their fp32 masters and compute
shards (:meth:`WholeParams.gathered <infinity.engine.gathered.WholeParams.gathered>` with ``modifier_rank=0``). The
model then computes, saves (``model.state_dict()``, :mod:`infinity.engine.model_state`) and trains on as plain
``peft``'s does.

With several ranks a gather is collective, and scripts often merge on one rank alone: there a merge is refused
before anything changes, naming ``infinity.hf.merge.save_merged`` (collective; it writes the merged model).
"""

from __future__ import annotations

import functools
import weakref

import torch

MERGE_METHODS = ("merge", "unmerge")
"""The methods of a ``peft`` adapter layer that write its base weight."""


def is_adapter_layer(module: torch.nn.Module) -> bool:
    """A ``peft`` tuner layer (LoRA's ``Linear``, ``Embedding``, ``Conv``, ... : by the class it derives from)."""
    return any(cls.__name__ == "BaseTunerLayer" and cls.__module__.split(".")[0] == "peft"
               for cls in type(module).__mro__)


class AdapterMergeHooks:
    """Each adapter layer's ``merge``/``unmerge``, wrapped on the instance to run with its parameters whole. They stay
    when the engine closes: a merge then is refused (its parameters are gone), not silently empty."""

    def __init__(self, owner, model: torch.nn.Module, managed):
        """``managed``: the ids of the parameters the engine partitions (a container of them)."""
        self._owner = weakref.ref(owner)  # the model does not keep a closed-over engine alive
        for name, module in model.named_modules():
            if not is_adapter_layer(module):
                continue
            params = [param for param in dict.fromkeys(module.parameters()) if id(param) in managed]
            if not params:
                continue
            for method in MERGE_METHODS:
                original = getattr(module, method, None)
                if callable(original):
                    module.__dict__[method] = self._whole_for(name, method, original, params)

    def _whole_for(self, name: str, method: str, original, params: list[torch.nn.Parameter]):
        @functools.wraps(original)
        def whole(*args, **kwargs):
            owner = self._owner()
            if owner is None:
                return original(*args, **kwargs)
            if owner.world_size > 1:
                raise RuntimeError(
                    f"{name}.{method}() of a model partitioned over {owner.world_size} ranks: its weights are "
                    "sliced over the ranks. Write the merged model with infinity.hf.merge.save_merged(engine, model, "
                    "out_dir) on every rank together (rank 0 writes), or `infinity train --merge-lora`")
            with owner.gathered_parameters(params, modifier_rank=0):  # collective; one rank here
                return original(*args, **kwargs)
        return whole
