"""``deepspeed.initialize`` and its companions (``init_distributed``, ``add_config_arguments``) over the engine.

``initialize`` takes DeepSpeed's arguments and returns DeepSpeed's four: the engine
(:class:`~infinity.deepspeed.engine.DeepSpeedEngine`), the optimizer as a script sees it (``engine.optimizer``, as
DeepSpeed's: :class:`~infinity.deepspeed.optimizer_view.OptimizerView`), a loader of ``training_data`` (or None) and
the learning-rate scheduler: the script's, or the config's (or None).

* The config: ``config`` (a dict or a JSON file's path; ``config_params``, its older name) or ``args.deepspeed_config``,
  not both. Any two of ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and
  ``gradient_accumulation_steps`` give the third, as DeepSpeed's do.
* ``model_parameters``: ``torch.optim``'s groups (their weight decay per group), or the parameters, which must be
  all those of the model that require grad (the engine trains those; a subset is refused naming what it leaves out).
* ``optimizer``: a ``torch.optim.AdamW`` or ``Adam`` (or ``deepspeed.ops.adam``'s ``DeepSpeedCPUAdam``, ``FusedAdam``)
  made by the script, where the config has no ``optimizer`` block:
  its lr, betas, eps and its groups' weight decay become the engine's (its states are the engine's own, fused CPU
  Adam or the device's). Any other optimizer, and a callable making one, is refused by name.
* ``lr_scheduler``: the script's scheduler over its ``optimizer`` (``transformers.get_scheduler``, torch's), or a
  callable making one from an optimizer; the engine steps it after each applied optimizer step and takes its
  learning rate (:mod:`~infinity.deepspeed.client_schedule`). Or the config's ``scheduler`` block, not both.
* Neither an ``optimizer`` block nor ``optimizer=...``: an engine that runs forwards only (inference, evaluation),
  whose ``backward`` and ``step`` refuse, as DeepSpeed's; the optimizer returned is None (DeepSpeed's ZeRO-3 returns
  its parameter offloader there, ``DeepSpeedZeRoOffload``, which is no optimizer either: no ``param_groups``, no
  ``step``).
* The config's ``tensorboard`` and ``csv_monitor`` blocks: each step's loss and lr, as DeepSpeed's monitor writes
  them (:mod:`~infinity.deepspeed.monitor`).
* ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (or its older names): what the engine's
  ``zero_gather_16bit_weights_on_model_save()`` answers, which accelerate's ``get_state_dict`` and ``save_model`` ask
  before gathering the model, as under DeepSpeed (without it they refuse, naming the key).
* Refused, naming the argument: ``mpu`` (model parallelism).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os

import torch
import torch.distributed as dist

from infinity.config.deepspeed import gathers_16bit_on_save, without_gather_16bit_keys
from infinity.config.monitors import MONITOR_BLOCKS, monitor_from_deepspeed
from infinity.config.schema import InfinityConfig, read_config_json
from infinity.deepspeed.client_schedule import ClientSchedule
from infinity.deepspeed.engine import DeepSpeedEngine
from infinity.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from infinity.optim.param_groups import is_label
from infinity.runtime.comm import process_group_backend
from infinity.weights.pretrained import streamed_from

logger = logging.getLogger(__name__)

CLIENT_ADAMS = (torch.optim.AdamW, torch.optim.Adam, DeepSpeedCPUAdam, FusedAdam)
"""The optimizers a script may make and pass: their hyperparameters become the engine's Adam's."""
_TORCH_ADAM_HOW = {"foreach", "fused", "capturable", "differentiable"}
"""Options of torch's Adam and AdamW that say how torch runs it, not what it computes: nothing to honour."""


def initialize(args=None, model: torch.nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port=None, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, config_params=None, **others):
    """``(engine, optimizer, training_dataloader, lr_scheduler)`` as DeepSpeed's ``initialize`` returns them (see the
    module's docstring). Everything is checked before the model is sharded."""
    if others:
        raise TypeError(f"initialize() got argument(s) not supported here: {', '.join(sorted(others))}")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"initialize(model=...) must be a torch.nn.Module, got {type(model).__name__}")
    if mpu is not None:
        raise ValueError("initialize(mpu=...): model parallelism is not supported (the engine is data parallel, "
                         "ZeRO stage 3)")
    raw = _config_dict(args, config, config_params)
    trains = optimizer is not None or "optimizer" in raw  # as DeepSpeed's has_optimizer
    param_groups = _groups_of_model_parameters(model, model_parameters)
    if optimizer is not None:
        raw, param_groups = _with_client_optimizer(raw, optimizer)
    client_schedule = _client_schedule(lr_scheduler, optimizer, raw)
    drop_last = bool(raw.get("dataloader_drop_last", False))
    gather_16bit_on_save = gathers_16bit_on_save(raw)  # the door's to honour (get_state_dict asks it)
    raw = without_gather_16bit_keys(raw)
    monitors = {key: monitor_from_deepspeed(raw.pop(key), key) for key in MONITOR_BLOCKS if key in raw}
    infinity_config = InfinityConfig.from_deepspeed(raw)  # a bad key is named here, before the ranks meet
    if dist_init_required is not False:
        init_distributed()
    engine = DeepSpeedEngine(model, infinity_config, param_groups=param_groups, drop_last=drop_last,
                             lr_scheduler=client_schedule, monitors=monitors, client_optimizer=optimizer,
                             gather_16bit_on_save=gather_16bit_on_save, weights=streamed_from(model),
                             trains=trains)
    loader = None if training_data is None else engine.deepspeed_io(training_data, collate_fn=collate_fn)
    return engine, engine.optimizer if trains else None, loader, engine.lr_scheduler


LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What ``torchrun`` (and DeepSpeed's launcher, and ``infinity deepspeed``) set for each process."""


def init_distributed(dist_backend: str | None = None, **ignored) -> None:
    """The process group of a run started by a launcher (``LAUNCHER_ENV`` set), made once, one process too, as
    DeepSpeed's makes it (a script then asks ``torch.distributed.get_rank()``); nothing to make for a process
    started alone. The backend: ``dist_backend``, or NCCL for the GPUs with gloo for host tensors where each rank
    has a GPU, else gloo."""
    if dist.is_initialized():
        return
    launched = all(name in os.environ for name in LAUNCHER_ENV)
    if not launched and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    dist.init_process_group(backend=dist_backend or process_group_backend())


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's ``--deepspeed`` and ``--deepspeed_config`` on ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="run under the engine (accepted for DeepSpeed's scripts; always on here)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="the DeepSpeed JSON config file")
    return parser


def _client_schedule(lr_scheduler, optimizer, raw: dict):
    """The script's scheduler over its ``optimizer`` (a :class:`ClientSchedule`), or its callable making one from
    the optimizer (kept as it is: the engine calls it once built), or None."""
    if lr_scheduler is None:
        return None
    if "scheduler" in raw:
        raise ValueError("initialize: both the config's scheduler block and lr_scheduler=... were given: give one")
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler if optimizer is None else ClientSchedule(lr_scheduler(optimizer), optimizer)
    if optimizer is None:
        raise ValueError("initialize(lr_scheduler=...): give the optimizer it moves as optimizer=... too (or a "
                         "callable making the scheduler from an optimizer)")
    return ClientSchedule(lr_scheduler, optimizer)


def _config_dict(args, config, config_params) -> dict:
    """The DeepSpeed config from ``config``, ``config_params`` or ``args.deepspeed_config``: exactly one."""
    if config is not None and config_params is not None:
        raise ValueError("initialize: give config or config_params (its older name), not both")
    given = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if given is not None and from_args is not None:
        raise ValueError(f"initialize: a config was given both as args.deepspeed_config ({from_args!r}) and as "
                         f"config=...: give one (DeepSpeed refuses both too)")
    given = given if given is not None else from_args
    if given is None:
        raise ValueError("initialize: no DeepSpeed config: pass config= (a dict, or a JSON file's path) or "
                         "args.deepspeed_config")
    if isinstance(given, (str, os.PathLike)):
        return read_config_json(given)
    if isinstance(given, dict):
        return copy.deepcopy(given)
    raise ValueError(f"initialize(config=...) must be a dict or a JSON file's path, got {type(given).__name__}")


def _groups_of_model_parameters(model: torch.nn.Module, model_parameters) -> list[dict] | None:
    """``torch.optim``'s groups as they are; parameters only where they are every trainable one (then None)."""
    if model_parameters is None:
        return None
    items = list(model_parameters)
    if items and all(isinstance(item, dict) for item in items):
        return items  # the engine checks them (weight decay per group; one lr, betas, eps)
    given = {id(item) for item in items}
    left_out = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in given]
    if left_out:
        shown = ", ".join(left_out[:3]) + (f" and {len(left_out) - 3} more" if len(left_out) > 3 else "")
        raise ValueError(f"initialize(model_parameters=...) leaves out {len(left_out)} parameter(s) of the model that "
                         f"require grad ({shown}): the engine trains every parameter that requires grad; freeze the "
                         f"others with requires_grad_(False)")
    return None


def _with_client_optimizer(raw: dict, optimizer) -> tuple[dict, list[dict]]:
    """The config with an ``optimizer`` block made from the script's ``torch.optim.AdamW`` or ``Adam``, and its
    groups (their weight decay)."""
    if "optimizer" in raw:
        raise ValueError("initialize: both the config's optimizer block and optimizer=... were given: give one "
                         "(DeepSpeed refuses both too)")
    if type(optimizer) not in CLIENT_ADAMS:
        what = getattr(optimizer, "__name__", type(optimizer).__name__)
        raise ValueError(f"initialize(optimizer={what}) is not supported: the engine's optimizer is Adam or AdamW "
                         f"(give a torch.optim.AdamW or Adam, deepspeed.ops.adam's DeepSpeedCPUAdam or FusedAdam, or "
                         f"the config's optimizer block)")
    groups = optimizer.param_groups
    first = groups[0]
    for i, group in enumerate(groups):
        for key in ("amsgrad", "maximize"):
            if group.get(key):
                raise ValueError(f"initialize(optimizer=...): param_groups[{i}] has {key}=True, which the engine's "
                                 f"Adam does not do")
        for key in ("lr", "betas", "eps"):
            if _number(group[key]) != _number(first[key]):
                raise ValueError(f"initialize(optimizer=...): param_groups[{i}]['{key}'] is {group[key]!r} but group "
                                 f"0's is {first[key]!r}: the engine's Adam has one {key} (only the weight decay may "
                                 f"differ between groups)")
        unknown = {key for key, value in group.items() if not is_label(value)} - {
            "params", "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay",
            "initial_lr"} - _TORCH_ADAM_HOW  # a label (a group's name, torch's param_names) tunes nothing
        if unknown:
            raise ValueError(f"initialize(optimizer=...): param_groups[{i}] has key(s) {sorted(unknown)} the engine "
                             f"cannot honour")
    decoupled = type(optimizer) is torch.optim.AdamW or bool(first.get("decoupled_weight_decay", False))
    params = {"lr": _number(first["lr"]), "betas": [_number(b) for b in first["betas"]], "eps": _number(first["eps"]),
              "weight_decay": _number(first["weight_decay"])}
    if not decoupled:
        params["adam_w_mode"] = False  # torch's Adam adds the decay to the gradient (L2), as DeepSpeed's does then
    block = {"type": "AdamW" if decoupled else "Adam", "params": params}
    return raw | {"optimizer": block}, [{"params": g["params"], "weight_decay": _number(g["weight_decay"])}
                                        for g in groups]


def _number(value):
    """A float from a plain number or a one-element tensor (torch's optimizers take both for lr)."""
    return float(value.item()) if isinstance(value, torch.Tensor) else value
