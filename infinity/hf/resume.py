"""What ``train(resume_from_checkpoint=...)`` and ``load_best_model_at_end`` load: a ``checkpoint-N/`` that an
``infinity.hf.Trainer`` wrote, our sharded checkpoint (its ``latest`` file) beside the Trainer's own files; or one
that holds the model alone (``save_only_model=True``, ours or the stock Trainer's: ``model.safetensors``, a peft
model's ``adapter_model.safetensors``, no optimizer state), whose weights become the engine's while the optimizer
and schedule start afresh, as the stock Trainer loads it.

A ``checkpoint-N/`` of the stock ``transformers.Trainer`` that holds torch's optimizer state (``optimizer.pt``) is
named for what it is before any work, with what the user can do (start from its weights with a fresh optimizer, or
go on with the stock Trainer), rather than failing in the engine's loader for want of a ``latest`` file.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from transformers.trainer_utils import get_last_checkpoint  # optional extra: reached only through infinity.hf.Trainer

from infinity.checkpoint import LATEST_FILE

STOCK_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
               "adapter_model.safetensors", "adapter_model.bin", "optimizer.pt")
"""What the stock Trainer writes into a checkpoint and ours does not: the model whole (or a peft model's adapters)
and torch's optimizer state."""
OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")
"""Torch's optimizer state, as the stock Trainer saves it (absent under ``save_only_model``)."""
WEIGHTS_FILE, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"
ADAPTERS_FILE = "adapter_model.safetensors"


def checkpoint_to_resume(args, resume_from_checkpoint):
    """The folder ``train()`` resumes from, as the stock Trainer chooses it (``True``: the last ``checkpoint-N`` in
    ``output_dir``), or None where it resumes from none (or finds none: the stock Trainer then says so)."""
    if resume_from_checkpoint is True:
        return get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    return None if resume_from_checkpoint in (None, False) else os.fspath(resume_from_checkpoint)


def refuse_stock_checkpoint(path, *, peft: bool) -> None:
    """Raise ``ValueError`` where ``path`` is a stock Trainer's checkpoint (it has the stock files and no ``latest``)
    that cannot be resumed here (torch's optimizer state, or a model alone but not :func:`model_only`), naming its
    files and the two ways on. Anything else is left to the loader."""
    if path is None or not os.path.isdir(path) or os.path.exists(os.path.join(path, LATEST_FILE)):
        return
    stock = [name for name in STOCK_FILES if os.path.isfile(os.path.join(path, name))]
    if not stock or model_only(path, peft=peft):
        return  # nothing of the stock Trainer's (the loader says so), or the model alone: its weights are resumed
    load = ("PeftModel.from_pretrained(base, that folder, is_trainable=True)" if peft
            else "AutoModelForCausalLM.from_pretrained(that folder)")
    if any(name in stock for name in OPTIMIZER_FILES):
        what, why, other = ("a checkpoint of the stock transformers.Trainer", "its optimizer state is torch's, which "
                            "the engine cannot resume", "to continue that run exactly, resume it with the stock "
                            "transformers.Trainer")
    else:
        what, why, other = ("a checkpoint of the model alone (save_only_model=True)", "this Trainer resumes such a "
                            f"checkpoint of this model from {ADAPTERS_FILE if peft else WEIGHTS_FILE} only",
                            "the stock transformers.Trainer resumes it with a fresh optimizer")
    raise ValueError(
        f"resume_from_checkpoint: {path!r} is {what} ({', '.join(stock)}; no {LATEST_FILE!r} file of an "
        f"infinity.hf.Trainer checkpoint): {why}. To start from its weights with a fresh optimizer and schedule, "
        f"build the model with {load} and call train() without resume_from_checkpoint; {other}. Nothing was loaded "
        f"or written")


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
    with engine.gathered_parameters(trainable, modifier_rank=0):
        result = set_peft_model_state_dict(model, weights)
    unexpected = list(getattr(result, "unexpected_keys", None) or [])
    if unexpected:
        raise ValueError(f"resume_from_checkpoint: {str(path)!r} holds adapters this model has not "
                         f"({', '.join(unexpected[:3])}): it is not this model's checkpoint")


def load_model_only(engine, model: torch.nn.Module, path) -> None:
    """The weights of a :func:`model_only` checkpoint made every parameter's full value (its fp32 master and
    compute shard), one tensor at a time; the optimizer's moments and step stay as they are (a fresh run's: the
    stock Trainer starts a fresh optimizer here too). ``ValueError`` naming a parameter the files lack or give
    another shape, before any is written. Collective: every rank calls it."""
    if os.path.isfile(os.path.join(path, WEIGHTS_INDEX)):
        with open(os.path.join(path, WEIGHTS_INDEX)) as f:
            file_of = json.load(f)["weight_map"]
    else:
        with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt") as f:
            file_of = {name: WEIGHTS_FILE for name in f.keys()}
    params = dict(model.named_parameters())  # a tied parameter once, under the name its file gives it
    wrong = [name for name in params if name not in file_of]
    if wrong:
        raise ValueError(f"resume_from_checkpoint: {str(path)!r} holds no tensor for {', '.join(wrong[:3])}"
                         f"{' and more' if len(wrong) > 3 else ''}: it is not this model's checkpoint")
    by_file: dict[str, list[str]] = {}
    for name in params:
        by_file.setdefault(file_of[name], []).append(name)
    for file, names in by_file.items():
        with safe_open(os.path.join(path, file), framework="pt") as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(params[name].shape):
                    raise ValueError(f"resume_from_checkpoint: {name} is {shape} in {str(path)!r}, the model's is "
                                     f"{tuple(params[name].shape)}: it is not this model's checkpoint")
    whole = engine.whole_params()
    for file, names in by_file.items():
        with safe_open(os.path.join(path, file), framework="pt") as f:
            for name in names:
                whole.write(params[name], f.get_tensor(name))
