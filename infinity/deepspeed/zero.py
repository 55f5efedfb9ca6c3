"""``deepspeed.zero``'s construction context: the parameters of a model built inside ``zero.Init(...)`` stay
shapes-only (the meta device) until ``initialize`` shards them, and get their initial values there, module by module;
its buffers are what the constructor computes, as under DeepSpeed (:func:`infinity.engine.materialize.Init`)."""

from __future__ import annotations

import contextlib
import enum

import torch

from infinity.engine.gathered import engine_of
from infinity.engine.materialize import Init as _meta_init


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's parameter status. A parameter a :class:`~infinity.deepspeed.engine.DeepSpeedEngine` manages
    carries ``ds_status``: ``AVAILABLE`` inside :class:`GatheredParameters`, ``NOT_AVAILABLE`` outside it (scripts
    test it to decide what to gather), with ``ds_id``, ``ds_numel`` and ``ds_shape`` as DeepSpeed's have them."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def Init(module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None, pin_memory=False,
         config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None, **unused):
    """DeepSpeed's ``zero.Init``: its arguments are accepted (where parameters rest is the config's to say at
    ``initialize``); ``enabled=False`` builds the model as it is. ``module``: a model built already is refused (its
    memory is taken by then)."""
    if module is not None:
        raise ValueError("zero.Init(module=...): the model is built already; build it inside `with zero.Init():` "
                         "instead, or pass it to initialize as it is")
    if mpu is not None:
        raise ValueError("zero.Init(mpu=...): model parallelism is not supported (the engine is data parallel)")
    return _meta_init() if enabled else contextlib.nullcontext()


class GatheredParameters:
    """DeepSpeed's ``zero.GatheredParameters``: inside the block each given parameter is whole (gathered from every
    rank); on exit with ``modifier_rank`` that rank's values become every rank's, in the fp32 masters too
    (:mod:`infinity.engine.gathered`). Collective: every rank enters it with the same parameters.

    ``params``: a parameter or an iterable of them; those no engine manages are whole already and left as they are
    (as DeepSpeed leaves a parameter that is not partitioned). ``fwd_module`` is accepted (a forward gathers what
    it uses by itself)."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if params is None:
            params = []
        elif isinstance(params, torch.Tensor):
            params = [params]
        params = list(params)
        self._context = contextlib.nullcontext()
        self._managed: list[torch.Tensor] = []  # those an engine manages: their ds_status changes in the block
        if not enabled or not params:
            return
        not_tensors = [type(p).__name__ for p in params if not isinstance(p, torch.Tensor)]
        if not_tensors:
            raise TypeError(f"zero.GatheredParameters takes parameters, got {', '.join(not_tensors)}")
        if any(p.is_meta for p in params):
            raise ValueError("zero.GatheredParameters: a parameter on the meta device (a model built inside "
                             "zero.Init) has no values before initialize; give them with initialize's param_init "
                             "(or the model's _init_weights), or gather it after initialize")
        owned = [(p, engine_of(p)) for p in params]
        engines = {id(e): e for _, e in owned if e is not None}
        if len(engines) > 1:
            raise ValueError("zero.GatheredParameters: the parameters belong to more than one engine")
        if engines:
            self._managed = [p for p, e in owned if e is not None]
            self._context = next(iter(engines.values())).gathered_parameters(self._managed, modifier_rank)

    def __enter__(self):
        entered = self._context.__enter__()
        for param in self._managed:
            if hasattr(param, "ds_status"):
                param.ds_status = ZeroParamStatus.AVAILABLE
        return entered

    def __exit__(self, *exc):
        for param in self._managed:
            if hasattr(param, "ds_status"):
                param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        return self._context.__exit__(*exc)


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's mark that ``module``'s forward uses ``parameter`` although another module owns it (a tied or
    shared weight), so that its ZeRO-3 gathers it for that forward. Nothing to do here: the engine's forward fetches
    any released parameter an op touches, wherever it is used (:class:`~infinity.params.hooks.FetchOnUse`), and its
    gradient is reduced wherever backward makes it. The arguments are checked as DeepSpeed's are."""
    _check_external("register_external_parameter", module, parameter)


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undoes :func:`register_external_parameter`: nothing to undo (see there)."""
    _check_external("unregister_external_parameter", module, parameter)


def _check_external(function: str, module, parameter) -> None:
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"zero.{function}(module=...) must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, torch.nn.Parameter):
        raise ValueError(f"zero.{function}(parameter=...) must be a torch.nn.Parameter, got "
                         f"{type(parameter).__name__}")
