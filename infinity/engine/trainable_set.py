"""The parameters a training forward may use: those :func:`infinity.initialize` partitioned, each trainable or
frozen as it was then.

The layout is decided once: a trainable parameter has a gradient slice, an fp32 master and moments; a frozen one
has none of them. A script that changes the set afterwards would train something other than what it asks for,
silently: peft's ``set_adapter("other")`` flips ``requires_grad`` (the old adapter keeps being stepped by its moments
while its gradients no longer come, the new one never steps), and ``add_adapter(...)`` adds parameters that are not
partitioned (they get gradients that no optimizer applies, and no save holds them). So a training forward first
checks the set, in one pass over the model's parameters, and names the first parameter that differs. A forward
without grad (evaluation, ``generate``) is not checked: peft's ``disable_adapter()`` clears ``requires_grad`` for
its duration, and nothing trains there.
"""

from __future__ import annotations

import torch


def refuse_changed_trainable_set(model: torch.nn.Module, sharded_by_param: dict) -> None:
    """Raise ``ValueError`` naming the first parameter of ``model`` that initialize did not partition, or whose
    ``requires_grad`` is no longer what its slot was laid out for. ``sharded_by_param``: id(param) ->
    :class:`~infinity.params.sharded_param.ShardedParam`."""
    for name, param in model.named_parameters():
        sharded = sharded_by_param.get(id(param))
        if sharded is None:
            raise ValueError(
                f"parameter {name!r} was added to the model after infinity.initialize (peft's add_adapter?): it is "
                f"not partitioned, so it would get gradients no optimizer applies. Add every adapter before "
                f"initialize (peft: add_adapter, then set_adapter for the one to train)")
        if param.requires_grad != sharded.slot.trainable:
            was = "trainable" if sharded.slot.trainable else "frozen"
            raise ValueError(
                f"parameter {sharded.name!r} was {was} at infinity.initialize and its requires_grad is now "
                f"{param.requires_grad} (peft's set_adapter, or requires_grad_ after initialize?): the engine keeps "
                f"optimizer states for the parameters trainable then, so it would train another set than asked. "
                f"Choose the trainable set (peft: set_adapter) before initialize, or initialize again for another")
