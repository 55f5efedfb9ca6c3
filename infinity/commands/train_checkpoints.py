"""Checkpoints of ``infinity train``: saving at steps, finding the one to resume from, and stopping a run
whose loss or gradient norm is no longer finite (with a checkpoint of its last good step).

Nothing is lost: a --save-dir holding another run's checkpoints is refused before any work unless the run resumes
from it or --overwrite says so; ``latest`` never moves back to an earlier step without a line saying so; --keep-last
removes only the oldest checkpoints, never the one ``latest`` names; a checkpoint that cannot be loaded is named with
the tags that exist beside it."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import re
import shutil
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from infinity.checkpoint import CheckpointError
from infinity.engine.engine import Engine
from infinity.weights.adapters import adapter_config_record, is_peft_model
from infinity.weights.export import hf_config_of

__all__ = ["SavePolicy", "add_arguments", "call_checkpoint", "checkpoint_dir_and_tag", "checkpoint_tags",
           "engine_has_checkpoints", "load", "save", "save_policy", "stop_on_nonfinite", "stop_on_signal"]

logger = logging.getLogger(__name__)


def engine_has_checkpoints() -> bool:
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
        save(engine, args.save_dir, step, corpus, losses, run=plan.run_settings)
        message += (f"; no update was made from it. The weights after step {step} are saved in "
                    f"{Path(args.save_dir) / f'step{step}'}.")
    if plan.rank == 0:
        advice = "Lower --lr or raise --warmup" + (", or train in fp32 (--precision fp32)" if plan.precision != "fp32"
                                                    else "")
        print(f"{message} {advice}.", file=sys.stderr, flush=True)
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


RESUME_LATEST = ""
"""``--resume`` given without a value: --save-dir's latest checkpoint."""
LATEST_FILE = "latest"
META_FILE = "meta.json"


def add_arguments(group) -> None:
    """--resume, --overwrite and --keep-last (--save-dir and --save-every are the train command's)."""
    group.add_argument("--resume", metavar="DIR", nargs="?", const=RESUME_LATEST,
                       help="resume from the latest checkpoint in DIR (or from DIR/TAG); with no DIR, from --save-dir's "
                            "latest (a fresh start when it holds none)")
    group.add_argument("--overwrite", action="store_true",
                       help="write into a --save-dir that holds another run's checkpoints, a --save-pretrained "
                            "folder that holds a model, or a --run-dir whose metrics.csv holds another run's steps "
                            "(refused without it)")
    group.add_argument("--keep-last", type=int, metavar="N",
                       help="keep only the N newest checkpoints in --save-dir (config: checkpoint.keep_last; default all)")


@dataclass(frozen=True, slots=True)
class SavePolicy:
    """Where checkpoints go and how many stay."""

    save_dir: str | None
    """--save-dir; None: no checkpoints."""
    keep_last: int | None = None
    """Checkpoints kept in ``save_dir`` (the newest, by step); None keeps all."""
    resume: str | None = None
    """The checkpoint folder to resume from (``DIR`` or ``DIR/TAG``), resolved; None for a fresh start."""


def checkpoint_tags(save_dir: str | Path) -> list[str]:
    """The complete checkpoints in ``save_dir`` (folders with a meta.json), oldest first: by step, then by name."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    tags = [p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / META_FILE).is_file()]
    return sorted(tags, key=lambda t: (_step_of(t) if _step_of(t) is not None else -1, t))


def _step_of(tag: str | None) -> int | None:
    match = re.fullmatch(r"step(\d+)", tag or "")
    return int(match.group(1)) if match else None


def _latest(save_dir: str | Path) -> str | None:
    try:
        return (Path(save_dir) / LATEST_FILE).read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None


def _describe_tags(save_dir: str | Path) -> str:
    tags = checkpoint_tags(save_dir)
    if not tags:
        return f"{save_dir} holds no checkpoint"
    latest = _latest(save_dir)
    return f"checkpoints in {save_dir}: {', '.join(tags)}" + (f" (latest: {latest})" if latest else "")


def save_policy(args: argparse.Namespace, ds: dict) -> SavePolicy:
    """Check --save-dir, --resume, --overwrite, --keep-last (and the config's ``checkpoint.keep_last``, taken out of
    ``ds``) before any work."""
    block = ds.get("checkpoint")
    config_keep = None
    if isinstance(block, dict) and "keep_last" in block:
        block = dict(block)
        config_keep = block.pop("keep_last")
        if block:
            ds["checkpoint"] = block
        else:
            ds.pop("checkpoint")
        if isinstance(config_keep, bool) or not isinstance(config_keep, int):
            raise ValueError(f"config key checkpoint.keep_last must be an integer, got {config_keep!r}")
    keep_last = args.keep_last if args.keep_last is not None else config_keep
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"--keep-last must be at least 1, got {keep_last}")
    if keep_last is not None and not args.save_dir:
        raise ValueError("--keep-last needs --save-dir")
    resume = args.resume
    if resume == RESUME_LATEST:
        if not args.save_dir:
            raise ValueError("--resume without a folder resumes from --save-dir's latest checkpoint: give --save-dir "
                             "(or --resume DIR)")
        if not _latest(args.save_dir) and checkpoint_tags(args.save_dir):
            tags = checkpoint_tags(args.save_dir)
            raise ValueError(f"--resume: --save-dir {args.save_dir!r} has no `{LATEST_FILE}` file naming the checkpoint "
                             f"to resume from (it holds {', '.join(tags)}): give --resume "
                             f"{Path(args.save_dir) / tags[-1]} to resume from one of them, or --overwrite without "
                             f"--resume to start afresh there")
        resume = args.save_dir if _latest(args.save_dir) else None
    elif resume is not None and not Path(resume).is_dir():
        if Path(resume).exists():
            raise NotADirectoryError(f"--resume {resume!r} is a file: give a save folder or one of its checkpoints")
        raise FileNotFoundError(f"--resume folder {resume!r} does not exist")
    if args.save_dir and not args.overwrite and checkpoint_tags(args.save_dir):
        resumes_here = resume is not None and Path(checkpoint_dir_and_tag(resume)[0]).resolve() == Path(args.save_dir).resolve()
        if not resumes_here:
            raise ValueError(f"--save-dir {args.save_dir!r} already holds another run's checkpoints "
                             f"({_describe_tags(args.save_dir).split(': ', 1)[-1]}): resume from them (--resume), "
                             f"choose another --save-dir, or give --overwrite to write there anyway")
    return SavePolicy(save_dir=args.save_dir, keep_last=keep_last, resume=resume)


def load(engine, resume: str) -> dict:
    """The checkpoint's client state; an unusable checkpoint is named with the tags that exist beside it."""

    save_dir, tag = checkpoint_dir_and_tag(resume)
    try:
        return call_checkpoint(engine.load_checkpoint, save_dir, tag) or {}
    except (CheckpointError, FileNotFoundError) as err:
        raise type(err)(f"{err}; {_describe_tags(save_dir)}") from None


def save(engine, save_dir: str, step: int, corpus, losses: list[float], keep_last: int | None = None,
         run: dict | None = None, stop=None) -> None:
    """Checkpoint ``step`` as ``step<N>`` in ``save_dir``, with the data's position, the losses so far and ``run``,
    the settings a --resume is held to (``train_resume.run_settings``); ``stop`` (a ``GracefulStop``) is told of
    the save, so that a forced stop does not leave it half-written."""
    tag = f"step{step}"
    before = _latest(save_dir) if engine.comm.rank == 0 else None
    import torch

    client_state = {"step": step, "corpus": corpus.state_dict(), "losses": losses}
    if run is not None:
        client_state["run"] = run
    hf_config = hf_config_of(engine.module, torch.float32)
    if hf_config is not None:  # so that `infinity consolidate --hf` can write config.json
        client_state["hf_config"] = hf_config
    if is_peft_model(engine.module):  # and, the base left out, the adapters in peft's layout
        client_state["peft_config"] = adapter_config_record(engine.module)
    # A frozen base (--lora-rank's) is left out: --resume builds it again from --hf-model, and the checkpoint's
    # fingerprint of it checks that it did.
    with stop.saving(tag) if stop is not None else nullcontext():
        call_checkpoint(engine.save_checkpoint, save_dir, tag=tag, client_state=client_state,
                        exclude_frozen_parameters=True)
    if engine.comm.rank != 0:
        return
    if _step_of(before) is not None and _step_of(before) > step:
        print(f"infinity train: note: {Path(save_dir) / LATEST_FILE} moved back from {before} to {tag} (this run "
              f"resumed from an earlier checkpoint or --overwrite was given); {before} is still there",
              file=sys.stderr, flush=True)
    if keep_last is not None:
        _keep_last(Path(save_dir), keep_last, latest=tag)


def _keep_last(save_dir: Path, keep: int, latest: str) -> None:
    """Remove the oldest checkpoints beyond ``keep``; never the one ``latest`` names."""
    tags = [t for t in checkpoint_tags(save_dir) if t != latest]
    for tag in tags[: max(0, len(tags) - (keep - 1))]:
        shutil.rmtree(save_dir / tag, ignore_errors=True)
        logger.info("removed checkpoint %s (--keep-last %d)", save_dir / tag, keep)


def stop_on_signal(args, plan, engine, monitor, corpus, losses: list[float], step: int, stop) -> int:
    """End a run that was told to stop (SIGTERM, SIGINT) at a step boundary: checkpoint, close, 128 + signal."""
    saved = ""
    if args.save_dir:
        if not (args.save_every and step % args.save_every == 0):  # (else it was saved just now)
            save(engine, args.save_dir, step, corpus, losses, plan.save.keep_last, run=plan.run_settings, stop=stop)
        saved = f"; checkpoint in {Path(args.save_dir) / f'step{step}'} (resume with --resume)"
    engine.close()
    monitor.close()
    if plan.rank == 0:
        print(f"infinity train: stopped by {stop.name} after step {step} of {plan.steps}{saved or '; no --save-dir, so no checkpoint'}",
              file=sys.stderr, flush=True)
    return stop.exit_code
