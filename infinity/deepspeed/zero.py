"""``deepspeed.zero``'s construction context: a model built inside ``zero.Init(...)`` stays shapes-only (the meta
device) until ``initialize`` shards it, and gets its initial values there, module by module
(:mod:`infinity.engine.materialize`)."""

from __future__ import annotations

import contextlib

from infinity.engine.materialize import Init as _meta_init


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
    """DeepSpeed's ``zero.GatheredParameters`` is not offered: the engine gathers a parameter only inside a
    module's forward and backward."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        raise NotImplementedError(
            "deepspeed.zero.GatheredParameters is not supported: read the whole model with "
            "engine.full_state_dict() (every rank calls it), and set initial values before initialize (a model "
            "built inside zero.Init gets them from its _init_weights or reset_parameters, or initialize's param_init)")
