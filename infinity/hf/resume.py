"""What ``train(resume_from_checkpoint=...)`` and ``load_best_model_at_end`` load: a ``checkpoint-N/`` that an
``infinity.hf.Trainer`` wrote, our sharded checkpoint (its ``latest`` file) beside the Trainer's own files; one that
holds the model alone (``save_only_model=True``, ours or the stock Trainer's: ``model.safetensors``, a peft model's
``adapter_model.safetensors``, no optimizer state), whose weights become the engine's while the optimizer and
schedule start afresh, as the stock Trainer loads it; or a ``checkpoint-N/`` of the stock ``transformers.Trainer``
with torch's optimizer state (``optimizer.pt``), which goes on as the stock Trainer would go on with it.

A stock checkpoint is resumed piece by piece, each from the file the stock Trainer reads it from: the weights (the
fp32 masters and compute shards) from ``model.safetensors`` (or its index; a peft model's adapters from
``adapter_model.safetensors``), the AdamW moments and step count from ``optimizer.pt``
(:func:`read_stock_optimizer`), the schedule from ``scheduler.pt``, and the step, epoch, data position and RNG from
``trainer_state.json`` and ``rng_state.pth`` by the stock Trainer's own code, as for our checkpoints. Torch's
optimizer state numbers the parameters, in the order of the param groups the stock ``create_optimizer`` built
(the decay group, then the no-decay group, each in ``named_parameters`` order, trainable ones only): the same
groups the engine is given, so index ``i`` is the ``i``-th parameter of those groups taken in turn. Everything is
checked before any of it is loaded (:func:`check_stock_checkpoint`): a parameter of another shape names itself
and both shapes; AdamW's hyperparameters that differ from the arguments (the stock Trainer would take the saved
ones silently) are named; and what cannot be resumed exactly is refused by name: an fp16 ``GradScaler``'s state
(``scaler.pt``; the engine's loss scaler is its own), AMSGrad or ``maximize``, a parameter with no moments (it
took no step in that run), weights only in ``pytorch_model.bin`` (transformers < 5), accelerate's ``optimizer.bin``.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from transformers.trainer_utils import get_last_checkpoint  # optional extra: reached only through infinity.hf.Trainer

from infinity.checkpoint import LATEST_FILE, CheckpointError
from infinity.checkpoint.files import read_meta
from infinity.checkpoint.publish import resolve_checkpoint

STOCK_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
               "adapter_model.safetensors", "adapter_model.bin", "optimizer.pt")
"""What the stock Trainer writes into a checkpoint and ours does not: the model whole (or a peft model's adapters)
and torch's optimizer state."""
OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")
"""Torch's optimizer state, as the stock Trainer saves it (absent under ``save_only_model``); accelerate's name."""
OPTIMIZER_FILE = "optimizer.pt"
SCALER_FILE = "scaler.pt"
"""The fp16 ``GradScaler``'s state, which the stock Trainer saves beside the optimizer's."""
TRAINER_STATE_FILE = "trainer_state.json"
SCHEDULER_FILE = "scheduler.pt"
WEIGHTS_FILE, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"
ADAPTERS_FILE = "adapter_model.safetensors"


def checkpoint_to_resume(args, resume_from_checkpoint):
    """The folder ``train()`` resumes from, as the stock Trainer chooses it (``True``: the last ``checkpoint-N`` in
    ``output_dir``), or None where it resumes from none (or finds none: the stock Trainer then says so)."""
    if resume_from_checkpoint is True:
        return get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    return None if resume_from_checkpoint in (None, False) else os.fspath(resume_from_checkpoint)


def check_stock_checkpoint(path, engine, model: torch.nn.Module, groups: list[list[tuple[str, torch.nn.Parameter]]],
                           args, *, peft: bool) -> None:
    """Raise ``ValueError`` where ``path`` is a stock Trainer's checkpoint (it has the stock files and no ``latest``)
    that cannot be resumed here, naming its files and what is wrong, before anything is loaded: a model alone but not
    :func:`model_only`; torch's optimizer state beside weights not in safetensors, or beside what cannot be resumed
    exactly, or of another model (:func:`read_stock_optimizer`). ``groups``: the trainable parameters by name in the
    stock ``create_optimizer``'s groups. Anything else is left to the loader."""
    if path is None or not os.path.isdir(path) or os.path.exists(os.path.join(path, LATEST_FILE)):
        return
    stock = [name for name in STOCK_FILES if os.path.isfile(os.path.join(path, name))]
    if not stock or model_only(path, peft=peft):
        return  # nothing of the stock Trainer's (the loader says so), or the model alone: its weights are resumed
    load = ("PeftModel.from_pretrained(base, that folder, is_trainable=True)" if peft
            else "AutoModelForCausalLM.from_pretrained(that folder)")
    has = lambda name: os.path.isfile(os.path.join(path, name))  # noqa: E731
    weights = ADAPTERS_FILE if peft else WEIGHTS_FILE
    if not any(has(name) for name in OPTIMIZER_FILES):
        what, why, other = ("a checkpoint of the model alone (save_only_model=True)", "this Trainer resumes such a "
                            f"checkpoint of this model from {weights} only",
                            "the stock transformers.Trainer resumes it with a fresh optimizer")
    elif not has(OPTIMIZER_FILE):
        what, why, other = ("a checkpoint with accelerate's optimizer state", f"this Trainer resumes torch's "
                            f"optimizer state from {OPTIMIZER_FILE} only", "resume it with the stock "
                            "transformers.Trainer to continue that run exactly")
    elif not (has(ADAPTERS_FILE) if peft else (has(WEIGHTS_FILE) or has(WEIGHTS_INDEX))):
        what, why, other = ("a checkpoint of the stock transformers.Trainer", f"this Trainer resumes its weights "
                            f"from {weights}{'' if peft else ' (or its index)'} only (transformers >= 5 writes it)",
                            "resume it with the stock transformers.Trainer to continue that run exactly")
    elif has(SCALER_FILE):
        what, why, other = ("a checkpoint of the stock transformers.Trainer", f"its fp16 GradScaler's state "
                            f"({SCALER_FILE}) cannot be resumed exactly: the engine's loss scaler is its own",
                            "resume it with the stock transformers.Trainer to continue that run exactly")
    else:
        shapes = engine.whole_params().shapes(model.named_parameters())
        if not peft:
            _weights_by_file(path, shapes)  # every parameter there, in its shape
        read_stock_optimizer(path, groups, shapes, args)
        if os.path.isfile(os.path.join(path, SCHEDULER_FILE)):
            schedule_of_one_group(path, len(groups))
        return
    raise ValueError(
        f"resume_from_checkpoint: {path!r} is {what} ({', '.join(stock)}; no {LATEST_FILE!r} file of an "
        f"infinity.hf.Trainer checkpoint): {why}. To start from its weights with a fresh optimizer and schedule, "
        f"build the model with {load} and call train() without resume_from_checkpoint; {other}. Nothing was loaded "
        f"or written")


def check_world_size(path, world_size: int) -> None:
    """Raise ``ValueError`` where ``path`` is an ``infinity.hf.Trainer`` checkpoint saved without its frozen base (a
    peft model's: the Trainer leaves the base out) by another number of processes than this run's, before anything
    is loaded: its shards hold the adapters' optimizer state beside a fingerprint of each process's slice of the
    base, and load only at the world size that saved them (the stock Trainer's DDP checkpoint holds whole tensors,
    and resumes at any). Anything else is left to the loader."""
    if path is None or not os.path.isfile(os.path.join(path, LATEST_FILE)):
        return
    try:
        meta = read_meta(resolve_checkpoint(path))
    except (OSError, CheckpointError):
        return  # the loader names what is wrong with it
    saved = int(meta.get("world_size", world_size))
    if meta.get("frozen_excluded") and saved != world_size:
        raise ValueError(
            f"resume_from_checkpoint: {os.fspath(path)!r} was saved by {saved} process(es) without the frozen base "
            f"(a peft model's checkpoint), and loads at {saved} only; this run has {world_size}. Launch it with "
            f"{saved} (torchrun --nproc_per_node {saved}), or start from its adapters with a fresh optimizer "
            f"(PeftModel.from_pretrained(base, that folder, is_trainable=True), train() without "
            f"resume_from_checkpoint). Nothing was loaded or written")


def stock_optimizer(path) -> bool:
    """``path`` is a stock Trainer's checkpoint with torch's optimizer state (``optimizer.pt``, no ``latest``)."""
    return (os.path.isfile(os.path.join(path, OPTIMIZER_FILE))
            and not os.path.exists(os.path.join(path, LATEST_FILE)))


def read_stock_optimizer(path, groups: list[list[tuple[str, torch.nn.Parameter]]], shapes: dict[str, tuple], args
                         ) -> tuple[dict[str, dict[torch.nn.Parameter, torch.Tensor]], int]:
    """The AdamW moments (``exp_avg``, ``exp_avg_sq``: by parameter) and step count in ``path/optimizer.pt``,
    mapped to the parameters of ``groups`` (the stock ``create_optimizer``'s, by name; ``shapes``: their full
    shapes), the file memory-mapped.
    ``ValueError`` naming the file and what does not fit: groups of other sizes, a parameter of another shape
    (both shapes), one with no moments, steps that differ, AMSGrad or ``maximize`` (the engine's AdamW has
    neither), and betas, eps or weight_decay other than ``args``'s (the stock Trainer would go on with the saved
    ones: the run would not be the one the arguments describe)."""
    file = os.path.join(path, OPTIMIZER_FILE)
    saved = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    saved_groups, states = saved.get("param_groups", []), saved.get("state", {})
    theirs, ours = [len(g.get("params", ())) for g in saved_groups], [len(group) for group in groups]
    if theirs != ours:
        raise ValueError(f"resume_from_checkpoint: {file!r} holds param groups of {theirs} parameters, this model's "
                         f"optimizer groups of {ours} (weight decay, none; trainable parameters only): it is not "
                         f"this model's checkpoint. Nothing was loaded or written")
    expected = {"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon, "amsgrad": False,
                "maximize": False}
    moments: dict[str, dict[torch.nn.Parameter, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
    steps: dict[float, str] = {}
    for group, named, decay in zip(saved_groups, groups, (args.weight_decay, 0.0)):
        for key, value in {**expected, "weight_decay": decay}.items():
            if key in group and _plain(group[key]) != _plain(value):
                way = (f"the engine's AdamW has no {key}" if key in ("amsgrad", "maximize") else
                       "set the TrainingArguments to the saved value")
                raise ValueError(f"resume_from_checkpoint: {file!r} was saved with {key}={group[key]!r}, these "
                                 f"arguments give {value!r}: the run would not go on as it was ({way}). Nothing was "
                                 f"loaded or written")
        for index, (name, param) in zip(group["params"], named):
            state = states.get(index, states.get(str(index)))
            if not state or "exp_avg" not in state or "exp_avg_sq" not in state:
                raise ValueError(f"resume_from_checkpoint: {file!r} holds no AdamW moments for {name} (it took no "
                                 f"step in that run, or another optimizer saved it): the engine steps every trainable "
                                 f"parameter with one step count. Nothing was loaded or written")
            for key in moments:
                if tuple(state[key].shape) != shapes[name]:
                    raise ValueError(f"resume_from_checkpoint: {name} is {tuple(state[key].shape)} in {file!r} "
                                     f"({key}), the model's is {shapes[name]}: it is not this model's "
                                     f"checkpoint. Nothing was loaded or written")
                moments[key][param] = state[key]
            steps.setdefault(float(state["step"]), name)
    if len(steps) > 1 or not steps or min(steps) < 1 or not min(steps).is_integer():
        said = ", ".join(f"{name}: {step:g}" for step, name in steps.items())
        raise ValueError(f"resume_from_checkpoint: {file!r} holds parameters stepped {said} times: the engine steps "
                         f"every trainable parameter with one count of at least one. Nothing was loaded or written")
    return moments, int(next(iter(steps)))


def schedule_of_one_group(path, groups: int) -> dict:
    """``path/scheduler.pt`` as the one param group of the Trainer's stand-in optimizer takes it: the stock
    Trainer's scheduler keeps a value per param group (``base_lrs``, ``_last_lr``, ``lr_lambdas``), the same for
    each of its ``groups`` since it gives them one learning rate; the first is kept. ``ValueError`` naming the key
    where they differ (the stand-in cannot step two learning rates)."""
    file = os.path.join(path, SCHEDULER_FILE)
    saved = torch.load(file, map_location="cpu", weights_only=True)
    for key, value in saved.items():
        if isinstance(value, list) and len(value) == groups:
            if any(v != value[0] for v in value[1:]):
                raise ValueError(f"resume_from_checkpoint: {file!r} schedules its param groups apart ({key}: "
                                 f"{value}): the engine steps every parameter with one learning rate. Nothing was "
                                 f"loaded or written")
            saved[key] = value[:1]
    return saved


def _plain(value) -> tuple:
    return tuple(float(v) for v in value) if isinstance(value, (tuple, list)) else (float(value),)


def load_stock_optimizer(engine, path, groups: list[list[tuple[str, torch.nn.Parameter]]], args) -> None:
    """The moments and step count of ``path/optimizer.pt`` (:func:`read_stock_optimizer`) made the engine's, and
    its counters set to the step ``trainer_state.json`` records, as our checkpoint restores them. Collective."""
    shapes = engine.whole_params().shapes(name_param for group in groups for name_param in group)
    moments, step = read_stock_optimizer(path, groups, shapes, args)
    engine.whole_params().write_moments(moments, step=step)
    with open(os.path.join(path, TRAINER_STATE_FILE)) as f:
        global_step = int(json.load(f)["global_step"])
    engine.global_step = global_step
    engine.micro_step = global_step * engine.config.gradient_accumulation_steps


def model_only(path, *, peft: bool) -> bool:
    """``path`` holds the whole model in safetensors (``peft``: a peft model's adapters) and no optimizer state nor
    ``latest``: a ``save_only_model`` checkpoint (ours or the stock Trainer's)."""
    has = lambda name: os.path.isfile(os.path.join(path, name))  # noqa: E731
    weights = has(ADAPTERS_FILE) if peft else (has(WEIGHTS_FILE) or has(WEIGHTS_INDEX))
    return weights and not has(LATEST_FILE) and not any(has(name) for name in OPTIMIZER_FILES)


def load_adapters_only(engine, model: torch.nn.Module, path) -> None:
    """A peft model's :func:`model_only` checkpoint: its adapters (and ``modules_to_save`` copies) loaded by peft's
    own ``set_peft_model_state_dict`` into the trainable parameters, held whole for it and sharded again; the
    optimizer stays a fresh run's, as the stock Trainer's. Collective: every rank calls it."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    weights = load_peft_weights(str(path), device="cpu")
    trainable = [p for p in model.parameters() if p.requires_grad]
    # peft's loader asks the model for its state_dict() to map the file's names to the model's, the keys alone: the
    # released base is not read whole for that (nor, at several ranks, refused: each rank loads the same file)
    with engine.gathered_parameters(trainable, modifier_rank=0), engine.model_state.keys_only():
        result = set_peft_model_state_dict(model, weights)
    unexpected = list(getattr(result, "unexpected_keys", None) or [])
    if unexpected:
        raise ValueError(f"resume_from_checkpoint: {str(path)!r} holds adapters this model has not "
                         f"({', '.join(unexpected[:3])}): it is not this model's checkpoint")


def load_model_only(engine, model: torch.nn.Module, path) -> None:
    """The weights of a :func:`model_only` checkpoint (or a stock Trainer's, beside its optimizer state) made every
    parameter's full value (its fp32 master and compute shard), one tensor at a time; the optimizer's moments and
    step stay as they are (a fresh run's: the stock Trainer starts a fresh optimizer here too). ``ValueError``
    naming a parameter the files lack or give another shape, before any is written. Collective: every rank calls
    it."""
    params = dict(model.named_parameters())  # a tied parameter once, under the name its file gives it
    whole = engine.whole_params()
    for file, names in _weights_by_file(path, whole.shapes(params.items())).items():
        with safe_open(os.path.join(path, file), framework="pt") as f:
            for name in names:
                whole.write(params[name], f.get_tensor(name))


def _weights_by_file(path, shapes: dict[str, tuple[int, ...]]) -> dict[str, list[str]]:
    """The model's parameters (``shapes``: each one's full shape, by name) by the safetensors file of ``path``
    that holds each; ``ValueError`` naming one the files lack or give another shape."""
    if os.path.isfile(os.path.join(path, WEIGHTS_INDEX)):
        with open(os.path.join(path, WEIGHTS_INDEX)) as f:
            file_of = json.load(f)["weight_map"]
    else:
        with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt") as f:
            file_of = {name: WEIGHTS_FILE for name in f.keys()}
    wrong = [name for name in shapes if name not in file_of]
    if wrong:
        raise ValueError(f"resume_from_checkpoint: {str(path)!r} holds no tensor for {', '.join(wrong[:3])}"
                         f"{' and more' if len(wrong) > 3 else ''}: it is not this model's checkpoint")
    by_file: dict[str, list[str]] = {}
    for name in shapes:
        by_file.setdefault(file_of[name], []).append(name)
    for file, names in by_file.items():
        with safe_open(os.path.join(path, file), framework="pt") as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != shapes[name]:
                    raise ValueError(f"resume_from_checkpoint: {name} is {shape} in {str(path)!r}, the model's is "
                                     f"{shapes[name]}: it is not this model's checkpoint")
    return by_file
