"""Module hooks: fetch a module's parameters before it runs and release them
after, in forward and again in backward. Hooks call into the fetch groups and
the gradient reducer; they hold no state of their own beyond the handles and a clock.

* forward pre-hook: fetch; wrap the inputs so that their backward releases
  (the module's backward is done when gradients reach its inputs) — or, for a
  ``torch.nn`` layer whose parameters all train, nothing: it is released once
  its parameters' gradients are ready (see :data:`RELEASED_ON_GRADS`);
* forward hook: release; hook the outputs so that the first gradient reaching
  them fetches again (the module's backward is about to run);
* a parameter's post-accumulate-grad hook hands its gradient to the reducer.

Every hook runs on the thread that feeds the device, and its seconds are counted (:class:`HookClock`,
``step_metrics()["hooks_s"]``): the engine's host-side work a small model's GPU waits for.

A module whose inputs need no gradient (the first layer, or every tile of a
tiled layer fed the same input) has no backward through its inputs; it is
released in backward once all its trainable parameters' gradients are ready.

A parameter used outside the forward of a module that owns it (in a parent's
forward, say) would be read while released: the :class:`FetchOnUse` mode,
active during the engine's forward where a parameter can be released, catches
that, fetches it and adds it to the running module's group, so later passes
fetch it with that module.

With one rank and every shard in device memory, each shard is its parameter's
full tensor and nothing is released: modules are then only fetched in forward
(the wait for the last step's updates behind it), and backward has no hooks
but the gradients'.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from infinity.params.sharded_param import ParamState, ShardedParam

logger = logging.getLogger(__name__)


RELEASED_ON_GRADS = (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm, torch.nn.RMSNorm, torch.nn.GroupNorm,
                     torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
"""Layers whose forward reads each parameter only through ops that also give it a gradient: once every parameter's
gradient is ready, no node of their backward reads a parameter again, so they are released then, without wrapping
their inputs in an autograd function. That wrap (a pytree walk and a Python ``autograd.Function``) was the largest
part of the engine's host time per module, and these layers hold nearly every parameter of a transformer. A module
keeps the wrap where its forward is not one of these classes' own (a subclass may override it), or where a parameter
is frozen: such a forward may save a parameter for backward without a gradient edge (``weight.detach()``), which a
release on gradients would free under it. So does a layer with a parameter another module owns too (a tied head),
whose gradient is ready only at the end of the other module's backward."""

_FORWARDS_RELEASED_ON_GRADS = frozenset(cls.forward for cls in RELEASED_ON_GRADS)


def released_on_grads(module: torch.nn.Module) -> bool:
    """The module runs the forward of one of :data:`RELEASED_ON_GRADS` (a subclass that only changes its init
    does)."""
    return type(module).forward in _FORWARDS_RELEASED_ON_GRADS


class FetchGroup:
    """The parameters one module uses, fetched and released together."""

    def __init__(self, name: str, params: list[ShardedParam], *, released_on_grads: bool = False):
        """``released_on_grads``: the module runs a forward of :data:`RELEASED_ON_GRADS` (:func:`released_on_grads`)."""
        self.name = name
        self.params = list(params)
        self.released_on_grads = released_on_grads and all(p.slot.trainable for p in self.params)
        """In backward it is released once its parameters' gradients are ready, whatever its inputs need."""
        self.release_on_grads = False        # this pass: release when its grads are ready (not its inputs' backward)
        self.awaiting_grads: set[int] = set()  # ids of parameters whose gradient this backward still waits for
        self.always_fetched = all(p.aliased for p in self.params)
        """Every parameter's shard is its full tensor (one rank, shards in device memory): nothing is ever
        released, so its forward hooks only fetch (which waits for the step's updates behind the forward) and
        its backward needs no hooks at all."""

    def fetch_for_backward(self) -> None:
        self.fetch()
        if self.release_on_grads:
            self.awaiting_grads = {id(p.param) for p in self.params if p.slot.trainable}

    def grad_ready(self, param: torch.nn.Parameter) -> None:
        if id(param) in self.awaiting_grads:
            self.awaiting_grads.discard(id(param))
            if not self.awaiting_grads:
                self.release()

    def add_external(self, param: ShardedParam) -> None:
        if param not in self.params:
            self.params.append(param)
            self.always_fetched = self.always_fetched and param.aliased
            self.released_on_grads = False  # the parameter is read by code outside the layer's own forward
            logger.info("%s uses %s outside that parameter's own module; it is now fetched with %s",
                        self.name or "the root module", param.name, self.name or "the root module")

    def fetch(self) -> None:
        for p in self.params:
            p.fetch()

    def release(self) -> None:
        for p in self.params:
            p.release()


class HookClock:
    """Seconds the engine's hooks ran, since the last :meth:`take` (one thread calls them: the one that feeds the
    device, in forward and in autograd's backward)."""

    __slots__ = ("seconds",)

    def __init__(self):
        self.seconds = 0.0

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _timed(clock: HookClock, hook: Callable) -> Callable:
    def timed(*args):
        start = time.perf_counter()
        try:
            return hook(*args)
        finally:
            clock.seconds += time.perf_counter() - start
    return timed


class _ReleaseAfterBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward runs once the module's backward is done."""

    @staticmethod
    def forward(ctx, group: FetchGroup, clock: HookClock, *inputs):
        ctx.group, ctx.clock = group, clock
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        start = time.perf_counter()
        ctx.group.release()
        ctx.clock.seconds += time.perf_counter() - start
        return (None, None, *grads)


def fetch_groups(model: torch.nn.Module, by_param: dict[int, ShardedParam]) -> dict[torch.nn.Module, FetchGroup]:
    """A group for each module that owns managed parameters (its own, not its children's)."""
    groups = {}
    for name, module in model.named_modules():
        params = [by_param[id(p)] for p in module.parameters(recurse=False) if id(p) in by_param]
        if params:
            groups[module] = FetchGroup(name, params, released_on_grads=released_on_grads(module))
    return groups


class ModuleHooks:
    """Installs and removes the hooks of every module that owns parameters."""

    def __init__(self, model: torch.nn.Module, groups: dict[torch.nn.Module, FetchGroup],
                 on_grad_ready: Callable[[torch.nn.Parameter], None], trainable: list[torch.nn.Parameter]):
        self.groups = groups
        self.running: list[FetchGroup] = []  # modules inside their forward, innermost last
        # every managed parameter is in its module's group, and whether it is aliased is fixed at construction
        self.nothing_released = all(group.always_fetched for group in groups.values())
        self._on_grad_ready = on_grad_ready
        self._groups_of: dict[int, list[FetchGroup]] = {}
        for group in groups.values():
            for p in group.params:
                self._groups_of.setdefault(id(p.param), []).append(group)
        for group in groups.values():
            if any(len(self._groups_of[id(p.param)]) > 1 for p in group.params):
                # a tied parameter's gradient is ready only once every module using it is done (a tied head would
                # stay gathered through all of backward): released after its own backward, by the wrap
                group.released_on_grads = False
        self.clock = HookClock()
        """Seconds in these hooks since the step meter last took them."""
        # each group's hook that fetches it again before its backward, made once
        self._refetch = {group: _timed(self.clock, lambda grads, group=group: group.fetch_for_backward())
                         for group in groups.values()}
        self._handles = []
        for module, group in groups.items():
            self._handles.append(module.register_forward_pre_hook(_timed(self.clock, self._pre_forward(group)),
                                                                  with_kwargs=True))
            self._handles.append(module.register_forward_hook(_timed(self.clock, self._post_forward(group))))
        grad_ready = _timed(self.clock, self._grad_ready)
        for param in trainable:
            self._handles.append(param.register_post_accumulate_grad_hook(grad_ready))

    def _grad_ready(self, param: torch.nn.Parameter) -> None:
        self._on_grad_ready(param)
        for group in self._groups_of.get(id(param), ()):
            group.grad_ready(param)

    def _pre_forward(self, group: FetchGroup):
        def hook(module, args, kwargs):
            if group.always_fetched and not any(p.update_pending for p in group.params):
                # never released, and no step's update of it runs behind this forward: nothing to fetch or wait for
                self.running.append(group)
                return None
            with torch._C.DisableTorchFunction():  # the engine's own ops: FetchOnUse need not check them
                group.fetch()
            self.running.append(group)
            if group.always_fetched or not torch.is_grad_enabled():
                return None  # no release to schedule after its backward
            if group.released_on_grads:
                group.release_on_grads = True
                return None
            wrapped = _wrap_for_release(group, self.clock, args, kwargs)
            group.release_on_grads = wrapped is None
            return wrapped
        return hook

    def _post_forward(self, group: FetchGroup):
        def hook(module, args, output):
            if self.running and self.running[-1] is group:
                self.running.pop()
            if group.always_fetched:
                if any(p.holders for p in group.params):
                    group.release()  # drops the holds its fetch took (its tensors stay: they are its shards)
                return None  # nothing to fetch again before its backward
            with torch._C.DisableTorchFunction():
                group.release()
            if not torch.is_grad_enabled():
                return None
            refetch = self._refetch[group]
            if type(output) is torch.Tensor:  # one output (most layers): its own hook, without a pytree walk
                if output.requires_grad:
                    output.register_hook(refetch)
                return None
            outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs:
                torch.autograd.graph.register_multi_grad_hook(outputs, refetch, mode="any")
            return None
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _wrap_for_release(group: FetchGroup, clock: HookClock, args, kwargs):
    flat, _ = tree_flatten((args, kwargs))
    needing = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
    if not needing:
        return None  # no gradient reaches the inputs; the end of backward releases
    wrapped = _ReleaseAfterBackward.apply(group, clock, *needing)
    wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
    replacement = {id(t): w for t, w in zip(needing, wrapped)}
    new_args, new_kwargs = tree_map(lambda x: replacement.get(id(x), x) if isinstance(x, torch.Tensor) else x,
                                    (args, kwargs))
    return new_args, new_kwargs


class FetchOnUse(TorchFunctionMode):
    """Fetches a managed parameter that an op touches while it is released, and waits for the last step's update
    of a resident one that an op touches before its module's fetch did."""

    def __init__(self, by_param: dict[int, ShardedParam], hooks: ModuleHooks, root_group: FetchGroup):
        super().__init__()
        self._by_param = by_param
        self._hooks = hooks
        self._root_group = root_group

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._fetch_released(args)
        if kwargs:
            self._fetch_released(kwargs.values())
        return func(*args, **kwargs)

    def _fetch_released(self, values) -> None:
        """Fetch the released managed parameters among ``values`` and the lists, tuples and dicts in them. Every
        op of the forward comes through here: a lookup by id per leaf, not a pytree flatten (which took half
        of a small model's forward on the CPU)."""
        for value in values:
            if type(value) in (list, tuple):
                self._fetch_released(value)
            elif type(value) is dict:
                self._fetch_released(value.values())
            elif isinstance(value, tuple):  # a named tuple
                self._fetch_released(value)
            else:
                sharded = self._by_param.get(id(value))
                if sharded is None or sharded.param is not value:
                    continue
                if sharded.state is ParamState.RELEASED:
                    group = self._hooks.running[-1] if self._hooks.running else self._root_group
                    group.add_external(sharded)
                    sharded.fetch()
                elif not sharded.new_shard_delivered:
                    # resident (never released), read before its module's fetch: the last step's update of its
                    # sub-group, running behind this forward, must have written it first
                    sharded.wait_for_new_shard()


def fetch_on_use(by_param: dict[int, ShardedParam], hooks: ModuleHooks, root_group: FetchGroup, *,
                 updates_behind: bool):
    """The forward's :class:`FetchOnUse` mode where a parameter can be released, or while the last step's updates
    run behind this forward (``updates_behind``). With one rank and every shard in device memory nothing is
    released (each shard is its full tensor), so once those updates are made no op's arguments need checking."""
    if not updates_behind and hooks.nothing_released:
        return contextlib.nullcontext()
    return FetchOnUse(by_param, hooks, root_group)
