"""Checkpoints of ``infinity train``: saving at steps, finding the one to resume from, and stopping a run
whose loss or gradient norm is no longer finite (with a checkpoint of its last good step)."""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

__all__ = ["call_checkpoint", "checkpoint_dir_and_tag", "engine_has_checkpoints", "save", "stop_on_nonfinite"]

logger = logging.getLogger(__name__)


def engine_has_checkpoints() -> bool:
    from infinity.engine import Engine

    return (hasattr(Engine, "save_checkpoint") and hasattr(Engine, "load_checkpoint")
            and importlib.util.find_spec("infinity.checkpoint") is not None)


def stop_on_nonfinite(args, plan, engine, corpus, losses: list[float], step: int, micro: int, value: float,
                      applied: bool = False) -> int:
    """Stop on a non-finite loss or gradient norm, saying so on stderr; exit status 1.

    A loss is caught before its backward (``applied`` False), so nothing of it reached the weights and they
    are saved as the checkpoint of the last good step when --save-dir is set (unless earlier micro-batches of
    the step were accumulated: a checkpoint is taken only at a step boundary). A gradient norm is seen after
    the step's update ran (``applied``): those weights are not worth saving.
    """
    where = f"step {step + 1}" + (f", micro-batch {micro + 1} of {plan.grad_accum}" if plan.grad_accum > 1 else "")
    what = "gradient norm" if applied else "loss"
    message = f"infinity train: stopped: the {what} is {value} at {where}"
    if applied:
        message += " (the loss was finite); that step's update is not saved, the last checkpoint written stays the latest."
    elif not args.save_dir:
        message += "; no update was made from it (give --save-dir to keep a checkpoint when this happens)."
    elif micro > 0:
        message += (f"; no update was made from it, but {micro} micro-batch(es) of the step were accumulated, so no "
                    f"checkpoint: the last one written stays the latest.")
    else:
        save(engine, args.save_dir, step, corpus, losses)
        message += (f"; no update was made from it. The weights after step {step} are saved in "
                    f"{Path(args.save_dir) / f'step{step}'}.")
    if plan.rank == 0:
        print(f"{message} Lower --lr, raise --warmup, or train in fp32 (--precision fp32).", file=sys.stderr, flush=True)
    engine.close()
    return 1


def call_checkpoint(fn, *a, **k):
    try:
        return fn(*a, **k)
    except NotImplementedError as err:
        raise ValueError(f"checkpoints are not supported by this build of the engine: {err}") from None


def checkpoint_dir_and_tag(path: str) -> tuple[str, str | None]:
    """``--resume DIR`` takes DIR's latest checkpoint; ``--resume DIR/TAG`` that one."""
    p = Path(path)
    if not (p / "latest").exists() and (p.parent / "latest").exists():
        return str(p.parent), p.name
    return str(p), None


def save(engine, save_dir: str, step: int, corpus, losses: list[float]) -> None:
    import torch

    from infinity.hf_export import hf_config_of

    client_state = {"step": step, "corpus": corpus.state_dict(), "losses": losses}
    hf_config = hf_config_of(engine.module, torch.float32)
    if hf_config is not None:  # so that `infinity consolidate --hf` can write config.json
        client_state["hf_config"] = hf_config
    call_checkpoint(engine.save_checkpoint, save_dir, tag=f"step{step}", client_state=client_state)
