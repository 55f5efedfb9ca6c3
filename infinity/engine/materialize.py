"""Initial values of parameters, one module at a time.

A model built under ``torch.device("meta")`` (or :func:`infinity.Init`, which
keeps the buffers its constructor computes) has parameters with shapes but no
values: each module that owns parameters is given real storage for its own
parameters only and initialized, so host memory holds one module's values at a
time, never the whole model's.

Each module is initialized by, in order of preference:

1. the user's ``param_init(module)`` callable (``initialize(..., param_init=fn)``);
2. the model's ``_init_weights(module)`` (the Hugging Face ``transformers``
   convention; the nearest ancestor that defines it is used, as
   ``PreTrainedModel.initialize_weights`` does);
3. the module's own ``reset_parameters()``.

The values equal what the same constructor gives on a real device from the
same random state. A real constructor draws in a fixed order: each module's
``reset_parameters`` as it is built (registration order); and, in the
``transformers`` convention, each model with ``_init_weights`` ends its own
``__init__`` (``post_init``) by applying it, children first, to every module
under it not yet initialized (a nested model, e.g. ``LlamaModel`` inside
``LlamaForCausalLM``, does so before its parent builds its next children).
:meth:`Initializer.prepare` replays that construction once, one module at a
time, and records the generator's state before each module's draws; a module
is then materialized from those states, so its values do not depend on the
order in which the engine asks for them. :func:`write_initial_shards` walks the
model and writes each module's values into this rank's shards as it goes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from typing import Callable

import torch
from torch.nn.modules.module import register_module_parameter_registration_hook
from tqdm import tqdm

from infinity.checkpoint.frozen import FrozenDigest
from infinity.engine.adapter_init import AdapterInit
from infinity.engine.stand_ins import stand_ins_for
from infinity.optim.offload_optimizer import OffloadOptimizer
from infinity.params.compute_shards import ComputeShards
from infinity.params.sharded_param import ShardedParam
from infinity.placement.layout import ParamSlot
from infinity.runtime.comm import Collectives
from infinity.weights.adapters import DRAWN_VALUES

logger = logging.getLogger(__name__)

PROGRESS_AFTER_S = 2.0
"""Loading pretrained weights shows a progress bar once it has taken this long."""

ParamInit = Callable[[torch.nn.Module], None]


@contextlib.contextmanager
def Init():
    """Build a model inside this context and its parameters stay shapes-only (the meta device) until ``initialize``
    shards them and gives each module's values; everything else the constructor computes is real, as it computes it
    (a rotary ``inv_freq``, a causal mask, a position table: buffers built under ``torch.device("meta")`` have no
    values, and only a module's ``reset_parameters``/``_init_weights`` could give them some).

    Each parameter is moved to the meta device as a module registers it (torch's parameter-registration hook), the
    same Python object (ties kept), before the constructor initializes it: the initializers then draw nothing, as on
    the meta device, and :class:`Initializer` replays their draws at ``initialize``. Its storage, allocated but
    never written, is freed at once. The hook is torch's global one: a model built in another thread meanwhile is
    built so too."""
    handle = register_module_parameter_registration_hook(_to_meta_as_registered)
    try:
        yield
    finally:
        handle.remove()


def _to_meta_as_registered(module: torch.nn.Module, name: str, param):
    """Inside :func:`Init`: a parameter a module registers is made shapes-only, in place where it can be (the same
    object, so that a tied parameter registered again is the meta one already)."""
    if param is None or param.is_meta:
        return None
    meta = torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    if type(param) is torch.nn.Parameter:
        try:
            torch.utils.swap_tensors(param, meta)  # `param` is now the meta one; its real storage goes with `meta`
            return None
        except RuntimeError:  # (a weak reference held to it): registered as a new object instead
            pass
    logger.debug("Init: %s.%s (%s) registered as a new meta parameter", type(module).__name__, name,
                 type(param).__name__)
    return meta


class Initializer:
    """The values a model's constructor would give its meta parameters, module by module."""

    def __init__(self, model: torch.nn.Module, param_init: ParamInit | None = None):
        if param_init is not None and not callable(param_init):
            raise ValueError(f"param_init must be a callable taking a module, got {type(param_init).__name__}")
        self.model = model
        self.param_init = param_init
        self._owner = _init_weights_owners(model) if param_init is None else {}
        self.mode = "param_init" if param_init is not None else ("_init_weights" if self._owner else "reset_parameters")
        self._reset_state: dict[int, torch.Tensor] = {}
        self._init_state: dict[int, torch.Tensor] = {}
        self._overwritten: set[int] = set()
        self._prepared = False

    def prepare(self) -> None:
        """Replay the constructor's random draws (one module at a time) and record where each module's begin.

        Called once, with the generator in the state the real constructor would
        start from; afterwards the generator is where the real constructor leaves it.
        """
        if self._prepared or self.mode != "_init_weights":
            self._prepared = True
            return
        built: set[int] = set()
        initialized: set[int] = set()

        def build(name: str, module: torch.nn.Module) -> None:
            if id(module) in built:
                return
            built.add(id(module))
            if _direct_params(module) and callable(getattr(module, "reset_parameters", None)):
                self._reset_state[id(module)] = torch.get_rng_state()
                self._run(module, name, module.reset_parameters, keep=False)
            for child_name, child in module.named_children():
                build(_join(name, child_name), child)
            if callable(getattr(module, "_init_weights", None)):  # its post_init
                for sub_name, sub, owner in _post_order(module, self._owner, name):
                    if id(sub) in initialized:
                        continue
                    initialized.add(id(sub))
                    if _direct_params(sub) or _direct_buffers(sub):
                        self._init_state[id(sub)] = torch.get_rng_state()
                        after = self._run(sub, sub_name, lambda m=sub, o=owner: o._init_weights(m), keep=True)
                        if all(not torch.isnan(v).any() for v in after.values()):
                            self._overwritten.add(id(sub))  # its reset_parameters values never survive

        build("", self.model)
        self._prepared = True
        logger.debug("replayed the constructor's draws of %d module(s) and _init_weights of %d",
                     len(self._reset_state), len(self._init_state))

    def values(self, module: torch.nn.Module, module_name: str, todo: list[tuple[str, torch.nn.Parameter]],
               original_data: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """The full fp32 values of ``todo`` (this module's parameters not yet sharded)."""
        if not any(original_data[id(p)].is_meta for _, p in todo):
            return [original_data[id(p)].detach().float() for _, p in todo]
        if self.mode == "param_init":
            init = lambda: self.param_init(module)  # noqa: E731
        elif self.mode == "_init_weights":
            init = lambda: self._replayed(module)  # noqa: E731
        else:
            reset = getattr(module, "reset_parameters", None)
            if not callable(reset):
                raise ValueError(
                    f"module {module_name or type(module).__name__!r} ({type(module).__name__}) has parameters on the "
                    f"meta device but no reset_parameters() to initialize them; define it, pass "
                    f"initialize(..., param_init=fn), or build the model on a real device")
            init = reset
        stand_ins = self._run(module, module_name, init, keep=True, original_data=original_data)
        out = []
        for local_name, param in todo:
            value = stand_ins[id(param)]
            if value.is_floating_point() and torch.isnan(value).any():
                raise ValueError(
                    f"parameter {_join(module_name, local_name)!r} was not initialized by {self._describe()}; "
                    f"initialize it there, pass initialize(..., param_init=fn), or build the model on a real device")
            out.append(value)
        return out

    def materialize_buffers(self) -> None:
        """Give buffers left on the meta device their values (e.g. rotary frequencies computed in ``__init__``)."""
        for name, module in self.model.named_modules():
            meta = [local for local, b in module._buffers.items() if b is not None and b.is_meta]
            if not meta:
                continue
            if self.mode == "param_init":
                init = lambda m=module: self.param_init(m)  # noqa: E731
            elif self.mode == "_init_weights" and id(module) in self._owner:
                init = lambda m=module: self._owner[id(m)]._init_weights(m)  # noqa: E731
            else:
                init = getattr(module, "reset_parameters", None)
            if not callable(init):
                raise ValueError(f"buffer {_join(name, meta[0])!r} of {type(module).__name__} is on the meta device; "
                                 f"give it a value in reset_parameters() or build it on a real device")
            buffers = {local: torch.full(module._buffers[local].shape, math.nan, dtype=module._buffers[local].dtype)
                       if module._buffers[local].is_floating_point() else
                       torch.zeros(module._buffers[local].shape, dtype=module._buffers[local].dtype) for local in meta}
            with torch.random.fork_rng(devices=[]):  # buffers draw nothing the parameters' replay counted on
                self._run(module, name, init, keep=False, buffers=buffers)
            for local, value in buffers.items():
                if value.is_floating_point() and torch.isnan(value).any():
                    raise ValueError(f"buffer {_join(name, local)!r} of {type(module).__name__} is on the meta device "
                                     f"and {self._describe()} did not set it; build the model with real buffers")
                module._buffers[local] = value
            logger.debug("%s: buffers %s materialized", name or type(module).__name__, meta)

    # -- internals ---------------------------------------------------------------------
    def _describe(self) -> str:
        return {"param_init": "param_init", "_init_weights": "reset_parameters() or _init_weights()",
                "reset_parameters": "reset_parameters()"}[self.mode]

    def _replayed(self, module: torch.nn.Module) -> None:
        """This module's constructor draws, then its ``_init_weights`` draws, each from its recorded state."""
        if not self._prepared:
            raise RuntimeError("internal error: Initializer.prepare() was not called")
        saved = torch.get_rng_state()
        try:
            if id(module) in self._reset_state and id(module) not in self._overwritten:
                torch.set_rng_state(self._reset_state[id(module)])
                module.reset_parameters()
            if id(module) in self._init_state:
                torch.set_rng_state(self._init_state[id(module)])
                self._owner[id(module)]._init_weights(module)
        finally:
            torch.set_rng_state(saved)

    def _run(self, module: torch.nn.Module, module_name: str, init: Callable[[], None], *, keep: bool,
             original_data: dict[int, torch.Tensor] | None = None,
             buffers: dict[str, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
        """Run ``init`` with every direct parameter (and ``buffers``) of ``module`` swapped for a stand-in
        with real storage; returns the stand-ins' values by the original parameter's id."""
        old_buffers = {local: module._buffers[local] for local in (buffers or {})}
        try:
            for local, value in (buffers or {}).items():
                module._buffers[local] = value
            with stand_ins_for([module], original_data) as values:
                init()
        finally:
            for local, value in old_buffers.items():
                module._buffers[local] = value
        return values if keep else {}


def _direct_params(module: torch.nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values())


def _direct_buffers(module: torch.nn.Module) -> bool:
    return any(b is not None for b in module._buffers.values())


def _join(module_name: str, local: str) -> str:
    return f"{module_name}.{local}" if module_name else local


def _init_weights_owners(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """For every module, the nearest ancestor (or itself) with a callable ``_init_weights``; empty when none has."""
    owners: dict[int, torch.nn.Module] = {}

    def walk(module: torch.nn.Module, owner: torch.nn.Module | None) -> None:
        if callable(getattr(module, "_init_weights", None)):
            owner = module
        if owner is not None:
            owners[id(module)] = owner
        for child in module.children():
            walk(child, owner)

    walk(model, None)
    return owners


def _post_order(model: torch.nn.Module, owners: dict[int, torch.nn.Module], prefix: str = ""):
    """(name, module, owner) children first, as ``Module.apply`` and ``PreTrainedModel.initialize_weights`` visit."""
    def walk(name: str, module: torch.nn.Module):
        for child_name, child in module.named_children():
            yield from walk(_join(name, child_name), child)
        if id(module) in owners:
            yield name, module, owners[id(module)]

    yield from walk(prefix, model)


def write_initial_shards(model: torch.nn.Module, params: "list[ShardedParam]", original_data: dict[int, torch.Tensor],
                     *, initializer: Initializer, weights, comm: "Collectives", compute: "ComputeShards",
                     optimizer: "OffloadOptimizer", frozen: FrozenDigest | None = None) -> None:
    """Shard every parameter's initial values into its tiers (compute shards, fp32 masters), one module at a time.

    A module whose parameters are on the meta device is materialized here
    (``reset_parameters``), so at most one module's full values exist at once.
    With ``weights`` (a pretrained model's files) each rank reads its own slices
    instead. ``original_data``: each parameter's values (or meta tensor) by id,
    dropped as it is written. ``frozen``: fingerprints the frozen parameters' compute shards as they are written.
    """
    pending_master: dict[int, torch.Tensor] = {}
    sharded_by_id = {id(s.param): s for s in params}
    done: set[int] = set()
    new_adapters = set() if weights is None else weights.initialized  # a peft model's, over a streamed base
    adapters = AdapterInit(model) if new_adapters else None
    initializing_meta = weights is None and any(t.is_meta for t in original_data.values())
    seed = _common_seed(comm) if initializing_meta or new_adapters else None
    rng = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
    with rng:
        if seed is not None:
            torch.manual_seed(seed)
        if initializing_meta:
            initializer.prepare()
        # Reading a large model's weights takes a while: a bar on stderr (on the first rank) once it has taken
        # PROGRESS_AFTER_S, as `infinity train` shows its steps; nothing for a quick load.
        bar = tqdm(total=sum(s.slot.numel for s in params), unit="param", unit_scale=True, desc="loading weights",
                   delay=PROGRESS_AFTER_S, leave=False, file=sys.stderr, dynamic_ncols=True,
                   disable=weights is None or comm.rank != 0)
        for module_name, module in model.named_modules():
            direct = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) in sharded_by_id]
            todo = [(n, p) for n, p in direct if id(p) not in done]
            if not todo:
                continue
            drawn = getattr(module, DRAWN_VALUES, None) if weights is not None else None
            drawn = drawn if drawn is not None and all(name in drawn for name, _ in todo) else None
            if weights is None:
                values = initializer.values(module, module_name, todo, original_data)
            elif drawn is not None:  # a peft model's new adapters, drawn before they followed their base to meta
                values = [drawn[name] for name, _ in todo]
                delattr(module, DRAWN_VALUES)
            elif any(sharded_by_id[id(p)].slot.name in new_adapters for _, p in todo):
                values = adapters.values(module_name, todo, original_data)
            else:  # each rank reads its own slices, nothing else
                values = [None] * len(todo)
            for (local_name, param), value in zip(todo, values):
                sharded = sharded_by_id[id(param)]
                if value is None:
                    shard = weights.read_shard(sharded.slot, comm.rank)
                else:
                    if comm.world_size > 1 and (drawn is not None or not original_data[id(param)].is_meta):
                        value = value.contiguous()
                        comm.broadcast_from_first(value)  # every rank starts from rank 0's weights
                    shard = shard_values(value, sharded.slot, comm.rank)
                if sharded.slot.trainable:
                    pending_master[sharded.slot.index] = shard
                compute_shard = shard.to(compute.dtype)
                handle = compute.write(sharded.slot, compute_shard)
                if frozen is not None and not sharded.slot.trainable:
                    frozen.add(sharded.slot.index, compute_shard)  # hashed beside the next read
                if handle is not None:
                    handle.wait()
                done.add(id(param))
                original_data[id(param)] = None
                bar.update(sharded.slot.numel)
            optimizer.init_master(pending_master)
        bar.close()
    if pending_master:
        raise RuntimeError(f"internal error: masters not written for slots {sorted(pending_master)}")


def _common_seed(comm: "Collectives") -> int | None:
    """A seed all ranks share, so a meta model is initialized the same on every rank."""
    if comm.world_size == 1:
        return None
    seed = torch.tensor([torch.initial_seed() % (1 << 62)], dtype=torch.int64)
    comm.broadcast_from_first(seed)
    return int(seed)


def shard_values(full: torch.Tensor, slot: ParamSlot, rank: int) -> torch.Tensor:
    """This rank's slice of a full tensor, flattened and zero-padded, in fp32."""
    flat = full.reshape(-1).float()
    start = rank * slot.shard_numel
    shard = torch.zeros(slot.shard_numel, dtype=torch.float32)
    valid = max(0, min(slot.numel - start, slot.shard_numel))
    if valid:
        shard[:valid].copy_(flat[start:start + valid])
    return shard


def replace_meta_parameters(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """Swap each meta parameter for a real (empty) one in every module that registers it, so tying holds.

    Returns, by the new parameter's id, the meta tensor it replaces (its shape
    and the signal that values must come from ``reset_parameters``).
    """
    replaced: dict[int, torch.nn.Parameter] = {}
    meta_of: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for local_name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in replaced:
                # the right shape, no bytes: the engine gives it storage when it is fetched
                real = torch.empty(param.shape, dtype=param.dtype)
                real.untyped_storage().resize_(0)
                new = torch.nn.Parameter(real, requires_grad=param.requires_grad)
                replaced[id(param)] = new
                meta_of[id(new)] = param.data
            module._parameters[local_name] = replaced[id(param)]
    return meta_of
