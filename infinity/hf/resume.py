"""What ``train(resume_from_checkpoint=...)`` resumes from: a ``checkpoint-N/`` that an ``infinity.hf.Trainer``
wrote, our sharded checkpoint (its ``latest`` file) beside the Trainer's own files.

A ``checkpoint-N/`` of the stock ``transformers.Trainer`` holds the model whole and torch's optimizer state instead
(``model.safetensors``, ``optimizer.pt``): the engine cannot take torch's optimizer state, so such a folder is named
for what it is before any work, with what the user can do (start from its weights with a fresh optimizer, or go on
with the stock Trainer), rather than failing in the engine's loader for want of a ``latest`` file.
"""

from __future__ import annotations

import os

from transformers.trainer_utils import get_last_checkpoint  # optional extra: reached only through infinity.hf.Trainer

from infinity.checkpoint import LATEST_FILE

STOCK_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
               "adapter_model.safetensors", "adapter_model.bin", "optimizer.pt")
"""What the stock Trainer writes into a checkpoint and ours does not: the model whole (or a peft model's adapters)
and torch's optimizer state."""


def checkpoint_to_resume(args, resume_from_checkpoint):
    """The folder ``train()`` resumes from, as the stock Trainer chooses it (``True``: the last ``checkpoint-N`` in
    ``output_dir``), or None where it resumes from none (or finds none: the stock Trainer then says so)."""
    if resume_from_checkpoint is True:
        return get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    return None if resume_from_checkpoint in (None, False) else os.fspath(resume_from_checkpoint)


def refuse_stock_checkpoint(path, *, peft: bool) -> None:
    """Raise ``ValueError`` where ``path`` is a stock Trainer's checkpoint (it has the stock files and no ``latest``),
    naming its files and the two ways on. Anything else is left to the loader."""
    if path is None or not os.path.isdir(path) or os.path.exists(os.path.join(path, LATEST_FILE)):
        return
    stock = [name for name in STOCK_FILES if os.path.isfile(os.path.join(path, name))]
    if not stock:
        return
    load = ("PeftModel.from_pretrained(base, that folder, is_trainable=True)" if peft
            else "AutoModelForCausalLM.from_pretrained(that folder)")
    raise ValueError(
        f"resume_from_checkpoint: {path!r} is a checkpoint of the stock transformers.Trainer ({', '.join(stock)}; no "
        f"{LATEST_FILE!r} file of an infinity.hf.Trainer checkpoint): its optimizer state is torch's, which the "
        f"engine cannot resume. To start from its weights with a fresh optimizer and schedule, build the model with "
        f"{load} and call train() without resume_from_checkpoint; to continue that run exactly, resume it with the "
        f"stock transformers.Trainer. Nothing was loaded or written")
