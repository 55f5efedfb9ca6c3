"""``model.state_dict()`` of a model the engine partitions gives whole values, never the empty tensors a released
parameter holds between passes: a script's own ``model.save_pretrained(dir)``, ``torch.save(model.state_dict(), f)``
or peft's ``save_pretrained`` writes the trained model, not a model of empty tensors (DeepSpeed's ZeRO-3 writes the
empty ones, silently).

With one rank each released parameter is read whole from its shards (its fp32 master; a frozen one's compute shard),
in the dtype the model computes in. With several ranks a gather is collective, and scripts often save on one rank
alone: there a state dict would hang or be empty, so it is refused, naming the collective forms. Where the engine's
own collective verbs let peft ask for a state dict whose keys alone it reads (its save names a ``modules_to_save``
copy's entries from it, its loader maps a file's names to the model's), :meth:`StateDictHooks.keys_only` leaves the
released entries empty instead, at any world size: nothing is gathered for names.

A state dict of the parameters themselves (``keep_vars=True``) is left as it is; so are the parameters a pass holds
whole and those never released (one rank, shards on the device). Either way the last step's updates that finish
behind the next forward are made first, so the values are the trained ones, as after ``optimizer.step()``.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from infinity.params.hooks import FetchGroup
from infinity.params.sharded_param import ShardedParam


class StateDictHooks:
    """A state-dict post-hook on each module that owns managed parameters: it fills their released entries."""

    def __init__(self, owner, groups: dict[torch.nn.Module, FetchGroup]):
        self._owner = weakref.ref(owner)
        # The state dict being filled and what was read into it: a tied parameter (a head sharing the embedding)
        # is an entry of each module owning it, and is read once, both entries one tensor as in a plain state dict.
        self._filling: weakref.ref | None = None
        self._read: dict[int, torch.Tensor] = {}
        self._keys_only = 0  # inside keys_only(): released entries are left empty, neither read nor refused
        self._handles = []
        for module, group in groups.items():
            self._handles.append(module.register_state_dict_pre_hook(self._landing))
            if group.always_fetched:
                continue  # never released: its entries are whole
            by_id = {id(sharded.param): sharded for sharded in group.params}
            own = {name: by_id[id(param)] for name, param in module._parameters.items()
                   if param is not None and id(param) in by_id}
            self._handles.append(module.register_state_dict_post_hook(self._filler(own)))

    def _landing(self, module, prefix, keep_vars) -> None:
        """Before a module's entries are taken: wait for the last step's updates behind the forward. A parameter
        held whole (never released, or kept gathered) is its own entry, and those updates write it in place: taken
        before them, a state dict would hold the step before (or values changing while it is saved)."""
        owner = self._owner()
        if owner is not None:
            owner.finish_step()

    def _filler(self, own: dict[str, ShardedParam]):
        def hook(module, state_dict, prefix, local_metadata) -> None:
            released = [(prefix + name, sharded) for name, sharded in own.items()
                        if (prefix + name) in state_dict
                        and state_dict[prefix + name] is not sharded.param  # keep_vars: the parameters themselves
                        and state_dict[prefix + name].numel() == 0 < sharded.slot.numel]
            owner = self._owner()
            if not released or owner is None or self._keys_only:
                return
            if owner.world_size > 1:
                raise RuntimeError(
                    f"state_dict() of a model partitioned over {owner.world_size} ranks: {released[0][0]} is empty "
                    "here (each rank holds a slice). Gather it on every rank together: engine.full_state_dict(), "
                    "engine.save_pretrained(dir) (rank 0 writes), engine.save_16bit_model(dir) under the DeepSpeed "
                    "door, or accelerator.get_state_dict(model)")
            if self._filling is None or self._filling() is not state_dict:
                self._filling, self._read = weakref.ref(state_dict, self._forget), {}  # a new state_dict() call
            whole = owner.whole_params()
            for key, sharded in released:
                if id(sharded) not in self._read:
                    self._read[id(sharded)] = whole.read_as_computed(sharded.param)
                state_dict[key] = self._read[id(sharded)]
        return hook

    @contextlib.contextmanager
    def keys_only(self):
        """A block in which ``state_dict()`` leaves released entries empty: for a caller that reads only its keys
        (peft's save asks each ``modules_to_save`` copy for its ``state_dict()`` to name the entries it takes from
        the state dict it was given), at one rank nothing is read whole for it, at several it is not refused."""
        self._keys_only += 1
        try:
            yield
        finally:
            self._keys_only -= 1

    def _forget(self, filled: weakref.ref) -> None:
        """The state dict was dropped: so are the values read into it (they are a whole model's)."""
        if self._filling is filled:
            self._filling, self._read = None, {}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
