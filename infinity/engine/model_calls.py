"""Calls of the model that do not come through the engine's forward: ``model.generate(...)``, a script's
``model(**batch)`` for evaluation, peft's ``generate`` (which calls the base model inside its wrappers).

Between the engine's passes a released parameter's ``.data`` is empty, so such a call would read empty weights.
Instead, a call of any module that holds the whole model (the root, and below it each module that still holds every
parameter: peft's ``LoraModel`` and the base model inside it) runs as one forward of the engine, exactly as
``engine(...)`` would: it is a pass with its fetches, prefetches, the fetch-on-use mode and the step's updates behind
it; under ``torch.no_grad()`` (as ``generate`` and evaluation run) it ends with the call, and with gradients a
backward through ``engine.backward`` follows, as after ``engine(...)``. A call of a part of the model (one layer)
fetches and releases that part, as :meth:`ShardedParam.fetch` does between passes.

With several ranks each forward gathers from all of them, so a rank whose ``generate`` is done must keep running
forwards until every rank is (transformers' ``synced_gpus``). transformers turns it on by itself under its own ZeRO-3
flag or for a module FSDP manages, which it recognizes by ``_is_fsdp_managed_module``: the modules that hold the whole
model carry that mark while the engine runs over several ranks, so a script's ``model.generate(...)`` does not hang
when the ranks stop at different lengths (transformers reads the mark nowhere else but to keep every rank running
every layer, as a speech model's layer drop does).

The hooks hold the engine through a weak reference: the model does not keep a closed-over engine alive.
"""

from __future__ import annotations

import weakref

import torch


SYNCED_CALLS_MARK = "_is_fsdp_managed_module"
"""What transformers reads to run ``generate`` with ``synced_gpus`` (FSDP's mark of a module it manages)."""


def whole_model_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model`` and, below it, the chain of modules that each hold every one of its parameters (a wrapper's
    wrapped model), outermost first."""
    total = sum(1 for _ in model.parameters())
    chain = [model]
    module = model
    while True:
        whole = [child for child in module.children() if sum(1 for _ in child.parameters()) == total]
        if len(whole) != 1:
            return chain
        module = whole[0]
        chain.append(module)


class ModelCallHooks:
    """Hooks on each module that holds the whole model: a call that did not begin inside the engine's forward opens
    one (``owner._open_forward``) and closes it when that module's forward returns or raises
    (``owner._close_forward``)."""

    def __init__(self, owner, model: torch.nn.Module):
        self._owner = weakref.ref(owner)
        self._opened_by: int | None = None  # the chain position of the module whose call opened the forward
        self._handles = []
        self._marked: list[torch.nn.Module] = []  # carry SYNCED_CALLS_MARK for the engine
        for position, module in enumerate(whole_model_modules(model)):
            if owner.world_size > 1 and not getattr(module, SYNCED_CALLS_MARK, False):
                setattr(module, SYNCED_CALLS_MARK, True)
                self._marked.append(module)
            # first of the module's pre-hooks (its own fetch hook comes after the pass has begun) and last of its
            # forward hooks (after its fetch group's release)
            self._handles.append(module.register_forward_pre_hook(self._before(position), with_kwargs=True,
                                                                  prepend=True))
            self._handles.append(module.register_forward_hook(self._after(position), always_call=True))

    def _before(self, position: int):
        def hook(module, args, kwargs):
            owner = self._owner()
            if owner is None:
                return None
            if owner.forward_running:
                if self._opened_by is None or position > self._opened_by:
                    return None  # inside the engine's forward, or inside the call that opened it
                # A module holding the whole model is called again while the forward its call (or a module
                # inside it) opened has not closed: that call was interrupted (a KeyboardInterrupt skips
                # torch's closing hooks). Close it as failed, then open this one.
                owner._close_forward(failed=True)
            args, kwargs = owner._open_forward(args, kwargs)
            self._opened_by = position
            return args, kwargs
        return hook

    def _after(self, position: int):
        def hook(module, args, output):
            if self._opened_by != position:
                return None
            self._opened_by = None
            owner = self._owner()
            if owner is not None and owner.forward_running:
                # torch calls this hook with no output when the forward raised: no backward can follow
                owner._close_forward(failed=output is None)
            return None
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in self._marked:
            delattr(module, SYNCED_CALLS_MARK)
        self._marked.clear()
