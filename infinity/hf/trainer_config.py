"""The engine's config for a Hugging Face ``Trainer`` run: the user's config, with the ``TrainingArguments`` in it.

``infinity_config=`` is a DeepSpeed-style dict, a path to such a JSON file, or an
:class:`~infinity.config.schema.InfinityConfig`. The Trainer's arguments decide the run's shape, as the
stock DeepSpeed integration makes them:

========================================  ==============================================================
key                                       from ``TrainingArguments``
========================================  ==============================================================
``train_micro_batch_size_per_gpu``        ``per_device_train_batch_size``
``gradient_accumulation_steps``           ``gradient_accumulation_steps``
``train_batch_size``                      world size x micro batch x accumulation
``gradient_clipping``                     ``max_grad_norm``
``optimizer.params.lr``                   ``learning_rate``
``optimizer.params.betas``                ``[adam_beta1, adam_beta2]``
``optimizer.params.eps``                  ``adam_epsilon``
``optimizer.params.weight_decay``         ``weight_decay``
``bf16.enabled`` / ``fp16.enabled``       ``bf16`` / ``fp16``
========================================  ==============================================================

``weight_decay`` goes where the stock Trainer puts it: the Trainer hands the engine its param groups, none on
biases and norms (:meth:`~infinity.hf.trainer.InfinityTrainerMixin._decay_groups`).

A key set to ``"auto"`` or left out takes the argument's value; a key set to another value must agree
with the argument, else a ``ValueError`` lists every disagreement (as the stock integration does). The
ZeRO sizes that DeepSpeed derives from the model's hidden size are filled as ``"auto"`` asks
(:func:`~infinity.config.auto.fill_auto`).

The learning rate of every step is set by the Trainer's scheduler. Without a DeepSpeed ``scheduler`` block that
is the Trainer's own (``lr_scheduler_type``, ``warmup_steps``...); with one, it is that block's schedule, as the
stock integration hands the step to DeepSpeed's scheduler then (:func:`deepspeed_scheduler`), "auto" filled the
same way:

========================================  ==============================================================
``scheduler.params.warmup_min_lr``        0
``scheduler.params.warmup_max_lr``        ``learning_rate``
``scheduler.params.warmup_num_steps``     ``get_warmup_steps(steps)``, at least 1
``scheduler.params.total_num_steps``      the run's optimizer steps
========================================  ==============================================================

An :class:`InfinityConfig` given as it is gets the same fields replaced by the arguments' values.

``zero_optimization.stage3_gather_16bit_weights_on_model_save: true`` (or its older names) has the Trainer write the
model's weights into each ``checkpoint-N`` too, as the stock DeepSpeed integration then does
(:func:`weights_in_checkpoints`); the engine's sharded checkpoint is there either way.
"""

from __future__ import annotations

import copy
import os

from infinity.config.auto import AUTO, fill_auto
from infinity.config.deepspeed import gathers_16bit_on_save, without_gather_16bit_keys
from infinity.config.lr_schedule import DeepSpeedScheduler, scheduler_from_deepspeed
from infinity.config.schema import InfinityConfig, read_config_json


ARGS_ATTRIBUTE = "infinity_config"
"""Where ``TrainingArguments`` hold the config under ``infinity deepspeed`` (their ``deepspeed`` value, which
:mod:`infinity.deepspeed.hf_scripts` moves there); the Trainer reads it when given no ``infinity_config=``."""


def config_source(infinity_config):
    """``infinity_config`` read once: an :class:`InfinityConfig` as it is, else its DeepSpeed-style dict (a JSON
    path read, a dict copied; ``{}`` for None). :func:`trainer_config` and :func:`deepspeed_scheduler` take
    either form."""
    return infinity_config if isinstance(infinity_config, InfinityConfig) else _read_raw(infinity_config)


def args_values(args, world_size: int) -> dict:
    """The DeepSpeed keys (dotted) the Trainer's arguments decide, with their values."""
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": world_size * micro * accumulation,
        "gradient_clipping": float(args.max_grad_norm or 0.0),
        "optimizer.params.lr": args.learning_rate,
        "optimizer.params.betas": [args.adam_beta1, args.adam_beta2],
        "optimizer.params.eps": args.adam_epsilon,
        "optimizer.params.weight_decay": args.weight_decay,
        "bf16.enabled": bool(args.bf16),
        "fp16.enabled": bool(args.fp16),
    }


def trainer_config(infinity_config, args, *, world_size: int, hidden_size: int | None) -> InfinityConfig:
    """The engine's config: ``infinity_config`` (dict, JSON path or InfinityConfig) with the arguments in it."""
    values = args_values(args, world_size)
    if isinstance(infinity_config, InfinityConfig):
        return _replace_from_args(infinity_config, values)
    raw = _read_raw(infinity_config)
    disagree = []
    for key, value in values.items():
        found = _lookup(raw, key)
        if found is not _MISSING and found != AUTO and not _same(found, value):
            disagree.append(f"{key}={found!r} but TrainingArguments say {value!r}")
    if disagree:
        raise ValueError("infinity_config disagrees with the TrainingArguments (set these keys to \"auto\" or to "
                         "the arguments' values): " + "; ".join(disagree))
    raw = fill_auto(raw, {}, hidden_size=hidden_size)
    for key, value in values.items():
        if key.startswith("fp16.") and not values["fp16.enabled"] and "fp16" not in raw:
            continue  # no fp16 block: nothing to turn off
        _set(raw, key, value)
    raw.setdefault("optimizer", {}).setdefault("type", "AdamW")
    raw.pop("scheduler", None)  # the Trainer's scheduler runs it (deepspeed_scheduler), not the engine
    return InfinityConfig.from_deepspeed(without_gather_16bit_keys(raw))  # (the Trainer's: weights_in_checkpoints)


def weights_in_checkpoints(source) -> bool:
    """Whether each ``checkpoint-N`` holds the model's weights in the Hugging Face layout besides the engine's
    shards: where the config (``source``, as :func:`config_source` read it) sets
    ``stage3_gather_16bit_weights_on_model_save``, as the stock DeepSpeed integration's checkpoints then do (so
    ``from_pretrained("checkpoint-N")`` loads); else the weights are the sharded checkpoint's alone, which its
    ``zero_to_fp32.py`` writes out."""
    return not isinstance(source, InfinityConfig) and gathers_16bit_on_save(source)


def deepspeed_scheduler(infinity_config, args, num_training_steps: int) -> DeepSpeedScheduler | None:
    """The config's DeepSpeed ``scheduler`` block for a run of ``num_training_steps`` optimizer steps, its "auto"
    values filled from the arguments as the stock integration fills them (see the module's docstring); None
    without a block. A value set otherwise that disagrees with the arguments is refused, as there."""
    if isinstance(infinity_config, InfinityConfig):
        return infinity_config.scheduler
    block = _read_raw(infinity_config).get("scheduler")
    if block is None:
        return None
    params = block.get("params") if isinstance(block, dict) else None
    if isinstance(params, dict):
        values = {"warmup_min_lr": 0.0, "warmup_max_lr": args.learning_rate,
                  "warmup_num_steps": max(1, args.get_warmup_steps(num_training_steps)),
                  "total_num_steps": num_training_steps}
        disagree = [f"scheduler.params.{key}={params[key]!r} but TrainingArguments say {value!r}"
                    for key, value in values.items()
                    if key != "warmup_min_lr" and params.get(key, AUTO) != AUTO and not _same(params[key], value)]
        if disagree:
            raise ValueError("infinity_config disagrees with the TrainingArguments (set these keys to \"auto\" or "
                             "to the arguments' values): " + "; ".join(disagree))
        block = {**block, "params": {key: values[key] if value == AUTO and key in values else value
                                     for key, value in params.items()}}
    return scheduler_from_deepspeed(block)


_MISSING = object()


def _read_raw(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        return read_config_json(config, "infinity_config file")
    raise ValueError(f"infinity_config must be a dict, a path to a JSON file or an InfinityConfig, "
                     f"got {type(config).__name__}")


def _lookup(raw: dict, dotted: str):
    block = raw
    for part in dotted.split("."):
        if not isinstance(block, dict) or part not in block:
            return _MISSING
        block = block[part]
    return block


def _set(raw: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    block = raw
    for part in parents:
        block = block.setdefault(part, {})
    block[last] = value


def _same(found, value) -> bool:
    if isinstance(value, list):
        return isinstance(found, (list, tuple)) and len(found) == len(value) and all(map(_same, found, value))
    if isinstance(value, bool) or isinstance(found, bool):
        return bool(found) == value
    try:
        return float(found) == float(value)
    except (TypeError, ValueError):
        return False


def _replace_from_args(config: InfinityConfig, values: dict) -> InfinityConfig:
    precision = "bf16" if values["bf16.enabled"] else "fp16" if values["fp16.enabled"] else "fp32"
    out = config.replace(micro_batch_size=values["train_micro_batch_size_per_gpu"],
                         train_batch_size=values["train_batch_size"],
                         gradient_accumulation_steps=values["gradient_accumulation_steps"],
                         gradient_clipping=values["gradient_clipping"], precision=precision, scheduler=None)
    return out.with_optimizer(lr=values["optimizer.params.lr"], betas=tuple(values["optimizer.params.betas"]),
                              eps=values["optimizer.params.eps"], weight_decay=values["optimizer.params.weight_decay"])
