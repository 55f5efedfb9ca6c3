"""What a Trainer run may write over in its ``output_dir``: never an earlier run's checkpoints, unless asked.

The stock Trainer saves ``checkpoint-<step>`` folders into ``output_dir`` whatever they hold: a second run there
replaces the first's ``checkpoint-10`` with its own, and ``save_total_limit`` deletes the first run's others as the
oldest. ``train()`` is refused before its first step where that would happen (the Trainer's saves are on and
``output_dir`` holds checkpoints), unless the run resumes from them (``resume_from_checkpoint``) or the user said
to write there anyway: ``Trainer(..., overwrite_output_dir=True)`` (the name the ``TrainingArguments`` of
transformers 4 gave it, honoured there too), or ``INFINITY_OVERWRITE_OUTPUT_DIR=1`` for a script run unchanged.
"""

from __future__ import annotations

import os

import torch
from transformers.trainer_utils import sort_checkpoints  # optional extra: reached only through infinity.hf.Trainer

from infinity.runtime.comm import Collectives

OVERWRITE_ENV = "INFINITY_OVERWRITE_OUTPUT_DIR"
"""Set to 1: a Trainer run writes into an ``output_dir`` holding checkpoints, as the stock Trainer does."""


def checkpoints_in(output_dir) -> list[str]:
    """The Trainer's checkpoint folders in ``output_dir``, by step: the ones its saves replace and its rotation
    deletes (transformers' own list)."""
    if not output_dir:
        return []
    return [os.path.basename(path) for path in sort_checkpoints(str(output_dir))]


def overwrite_asked(args, overwrite_output_dir: bool) -> bool:
    """The Trainer's keyword, the arguments' field (transformers 4's ``TrainingArguments``) or the variable."""
    return (bool(overwrite_output_dir) or bool(getattr(args, "overwrite_output_dir", False))
            or os.environ.get(OVERWRITE_ENV, "") not in ("", "0"))


def refuse_earlier_checkpoints(args, resume_from_checkpoint, *, overwrite: bool, comm: Collectives) -> None:
    """Raise ``ValueError`` naming ``output_dir`` and its checkpoints where this run's saves would write over them.
    Every rank decides the same (one all-reduce), so none is left waiting in the run's first collective."""
    saves = str(getattr(args.save_strategy, "value", args.save_strategy)) != "no"
    found = checkpoints_in(args.output_dir) if saves and not resume_from_checkpoint and not overwrite else []
    flag = torch.tensor([1.0 if found else 0.0])
    comm.all_reduce_max(flag)  # a rank that sees none refuses with the one that does (one rank: as it is)
    if not flag.item():
        return
    listed = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    where = f" ({listed})" if found else " on another rank"
    raise ValueError(
        f"output_dir {str(args.output_dir)!r} holds an earlier run's checkpoints{where}, which this run's saves would "
        f"replace or rotate away: resume from them with trainer.train(resume_from_checkpoint=True), choose another "
        f"output_dir, remove them, or pass Trainer(..., overwrite_output_dir=True) ({OVERWRITE_ENV}=1 for a script "
        f"run unchanged) to write there anyway")
