"""The parameters a training forward may use: those :func:`infinity.initialize` partitioned, each trainable or
frozen as it was then.

The layout is decided once: a trainable parameter has a gradient slice, an fp32 master and moments; a frozen one
has none of them. A script that changes the set afterwards would train something other than what it asks for,
silently: peft's ``set_adapter("other")`` flips ``requires_grad`` (the old adapter keeps being stepped by its moments
while its gradients no longer come, the new one never steps), and ``add_adapter(...)`` adds parameters that are not
partitioned (they get gradients that no optimizer applies, and no save holds them). So a training forward first
checks the set and names the first parameter that differs. A forward without grad (evaluation, ``generate``) is not
checked: peft's ``disable_adapter()`` clears ``requires_grad`` for its duration, and nothing trains there.

The check is cheap enough for every forward: each partitioned parameter's ``requires_grad`` is read from a list
kept since ``initialize``, and the model is walked again (``named_parameters``: milliseconds for a model of
thousands of tensors, too slow for every micro-batch) only where some module registered a parameter or a submodule
since the last walk, which torch's global registration hooks count.
"""

from __future__ import annotations

import torch
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

_registrations = [0]
"""Parameters and submodules registered on any module of this process so far (peft's ``add_adapter`` does both)."""


def _count(module, name, value) -> None:
    _registrations[0] += 1


register_module_parameter_registration_hook(_count)
register_module_module_registration_hook(_count)


class TrainableSet:
    """The model's parameters as ``initialize`` partitioned them, checked before each training forward."""

    def __init__(self, model: torch.nn.Module, sharded_by_param: dict):
        """``sharded_by_param``: id(param) -> :class:`~infinity.params.sharded_param.ShardedParam`, every
        parameter of ``model``."""
        self._model = model
        self._by_param = sharded_by_param
        self._walked_at = _registrations[0]
        self._params = [(param, sharded) for param, sharded in
                        ((p, sharded_by_param.get(id(p))) for p in model.parameters()) if sharded is not None]

    def refuse_changes(self) -> None:
        """Raise ``ValueError`` naming the first parameter of the model that ``initialize`` did not partition, or
        whose ``requires_grad`` is no longer what its slot was laid out for."""
        if _registrations[0] != self._walked_at:  # something was added somewhere since: walk the model
            for name, param in self._model.named_parameters():
                if id(param) not in self._by_param:
                    raise ValueError(
                        f"parameter {name!r} was added to the model after infinity.initialize (peft's add_adapter?): "
                        f"it is not partitioned, so it would get gradients no optimizer applies. Add every adapter "
                        f"before initialize (peft: add_adapter, then set_adapter for the one to train)")
            self._walked_at = _registrations[0]
        for param, sharded in self._params:
            if param.requires_grad != sharded.slot.trainable:
                was = "trainable" if sharded.slot.trainable else "frozen"
                raise ValueError(
                    f"parameter {sharded.name!r} was {was} at infinity.initialize and its requires_grad is now "
                    f"{param.requires_grad} (peft's set_adapter, or requires_grad_ after initialize?): the engine "
                    f"keeps optimizer states for the parameters trainable then, so it would train another set than "
                    f"asked. Choose the trainable set (peft: set_adapter) before initialize, or initialize again for "
                    f"another")
