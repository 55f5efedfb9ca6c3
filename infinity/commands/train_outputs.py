"""What an ``infinity train`` run will write, checked before its first step, so that no training is lost to a
write that fails at its end:

* every output (--save-dir, --run-dir, --tensorboard, --save-pretrained, --trace) can be written: a probe file is
  made in it, or in the nearest folder above it that exists (nothing is made for an output that does not exist);
* the large ones have room: the checkpoints this run keeps at once and the --save-pretrained model, added to the
  swap files when they share a disk, against that disk's free bytes, all named in the message;
* a folder that holds a model is not written over without --overwrite, and ``--save-pretrained`` is never the
  ``--hf-model`` folder the run reads;
* the save folder is owned by this run for its life (:mod:`infinity.checkpoint.save_dir_lock`): a second run on it
  is refused naming the first's pid and host, or waits for it with --wait-for-lock.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import uuid
from pathlib import Path

from infinity.checkpoint.files import is_checkpoint_folder
from infinity.checkpoint.save_dir_lock import SaveDirInUse, hold_save_dir
from infinity.placement.report import format_bytes
from infinity.weights.export import model_files

__all__ = ["DEFAULT_SAVE_DTYPE", "check_model_folder", "check_output_room", "check_outputs_writable",
           "hold_save_dir_for_run"]

DEFAULT_SAVE_DTYPE = "fp32"
"""--save-pretrained's dtype when --save-dtype is not given."""
SAVE_DTYPE_NBYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def check_model_folder(flag: str, folder: str, *, overwrite: bool) -> None:
    """``FileExistsError`` when ``folder`` holds a model (:func:`infinity.weights.export.model_files`) and
    ``overwrite`` was not given: a model is replaced only when asked (the folder's other files stay); and, asked or
    not, when it is a checkpoint folder."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{flag} {folder!r} is a file, not a folder")
    if is_checkpoint_folder(path):  # (its shards are *.safetensors: --overwrite would delete them as a model's)
        raise FileExistsError(f"{flag} {folder!r} is a checkpoint folder: writing a model there would replace its "
                              f"shard files, even with --overwrite; choose another folder")
    found = model_files(folder)
    if found and not overwrite:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise FileExistsError(f"{flag} {folder!r} already holds a model ({shown}): give --overwrite to replace it "
                              f"(the folder's other files stay), or choose another folder")


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_writable(flag: str, path: str | os.PathLike) -> None:
    """``OSError`` naming ``flag`` and ``path`` unless a file can be made in ``path`` (a folder) or, when it does
    not exist yet, in the nearest folder above it that does. Nothing is left behind."""
    target = Path(path)
    where = _nearest_existing(target)
    if not where.is_dir():
        raise NotADirectoryError(f"{flag} {str(path)!r}: {str(where)!r} is a file, not a folder")
    probe = where / f".infinity-probe-{uuid.uuid4().hex}"
    try:
        with open(probe, "xb") as f:
            f.write(b"\0")
        probe.unlink()
    except OSError as err:
        said = "" if where == target.absolute() else f" (it would be made in {str(where)!r})"
        raise PermissionError(f"{flag} {str(path)!r} is not writable{said}: {err.strerror or err}; the run would "
                              f"fail when it writes there, so it does not start") from None


def check_outputs_writable(args: argparse.Namespace, plan) -> None:
    """Every output of the run can be written, and --save-pretrained neither is the --hf-model folder nor holds a
    model without --overwrite; before any work."""
    outputs = [("--save-dir", args.save_dir), ("--save-pretrained", getattr(args, "save_pretrained", None)),
               ("--trace", os.path.dirname(os.path.abspath(args.trace)) if args.trace else None)]
    if plan.monitor is not None:
        outputs += [("--run-dir", plan.monitor.run_dir), ("--tensorboard", plan.monitor.tensorboard_dir)]
    for flag, path in outputs:
        if path is not None:
            _check_writable(flag, path)
    out = getattr(args, "save_pretrained", None)
    if out is None:
        return
    if plan.hf_model is not None and os.path.realpath(out) == os.path.realpath(plan.hf_model):
        raise ValueError(f"--save-pretrained {out!r} is the --hf-model folder the run reads: writing the tuned model "
                         f"there would replace the model it started from; give another folder")
    check_model_folder("--save-pretrained", out, overwrite=args.overwrite)


def checkpoint_saves(args: argparse.Namespace, plan) -> int:
    """How many checkpoints this run writes: every --save-every steps and at the end."""
    if not args.save_dir:
        return 0
    return 1 + (len(range(args.save_every, plan.steps, args.save_every)) if args.save_every else 0)


def checkpoints_needed_at_once(args: argparse.Namespace, plan) -> int:
    """How many checkpoints must fit for the run to end well: with --keep-last N, N of them plus the one being
    written (or every save, when fewer); without it, one (each later save's room is said, not required: the
    checkpoints written before the disk fills are whole)."""
    saves = checkpoint_saves(args, plan)
    keep = plan.save.keep_last if plan.save is not None else None
    return min(saves, 1 if keep is None else keep + 1)


def check_output_room(args: argparse.Namespace, plan, num_params: int, warn=None) -> None:
    """The checkpoints this run must keep at once and the --save-pretrained model fit their disks, with the swap
    files when they share one; ``OSError`` naming each part, the sum and the free bytes. After the estimate is
    made. Checkpoints kept without --keep-last that would fill the disk later are said with ``warn`` (stderr)."""
    needs: dict[int, list[tuple[str, str, int]]] = {}  # disk -> [(what, path, bytes)]

    def need(what: str, path, nbytes: int) -> None:
        if path is None or nbytes <= 0:
            return
        where = _nearest_existing(Path(path))
        needs.setdefault(os.stat(where).st_dev, []).append((what, str(where), nbytes))

    kept = checkpoints_needed_at_once(args, plan)
    # (the run's checkpoints leave the frozen parameters out: train_checkpoints.save)
    one = (plan.estimate["checkpoint_nbytes"] - plan.estimate.get("checkpoint_frozen_nbytes", 0)) * plan.world_size
    need(f"{kept} checkpoint(s) of {format_bytes(one)} in --save-dir", args.save_dir, kept * one)
    out = getattr(args, "save_pretrained", None)
    dtype = args.save_dtype or DEFAULT_SAVE_DTYPE
    need(f"the --save-pretrained model ({dtype})", out, num_params * SAVE_DTYPE_NBYTES[dtype])
    if needs:  # the swap files count where they share a disk with these
        swap_parent = plan.swap.parent if plan.nvme_is_temporary and plan.swap is not None else plan.nvme_path
        if swap_parent is not None:
            need("the swap files", swap_parent, plan.estimate["totals"]["nvme"] * plan.local_world_size)
    for parts in needs.values():
        if all(what == "the swap files" for what, _, _ in parts):
            continue  # (train_checks.check_nvme_room has checked it alone)
        total = sum(n for _, _, n in parts)
        free = shutil.disk_usage(parts[0][1]).free
        if total > free:
            said = " + ".join(f"{what} {format_bytes(n)}" for what, _, n in parts)
            raise OSError(f"not enough room on the disk of {parts[0][1]!r} for what this run will write: {said} = "
                          f"{format_bytes(total)} ({total:,} bytes) but {format_bytes(free)} ({free:,} bytes) are "
                          f"free; the run would fail when it writes there, so it does not start (free room, lower "
                          f"--keep-last, or write elsewhere)")
    saves = checkpoint_saves(args, plan)
    if saves > kept and warn is not None:
        free = shutil.disk_usage(_nearest_existing(Path(args.save_dir))).free
        if saves * one > free:
            warn(f"warning: --save-dir keeps all {saves} checkpoints of {format_bytes(one)} ({format_bytes(saves * one)})"
                 f" but {format_bytes(free)} are free: the disk fills after about {max(1, free // one)} of them; "
                 f"give --keep-last N to keep only the newest")


def hold_save_dir_for_run(args: argparse.Namespace, rank: int):
    """Rank 0 takes --save-dir for the run's life (refused naming the live run that holds it, or with
    --wait-for-lock waiting for it); the lock, or None without --save-dir or on other ranks."""
    if not args.save_dir or rank != 0:
        return None

    def waiting(holder: str) -> None:
        print(f"infinity train: --save-dir {args.save_dir!r} is in use by another live run ({holder}); waiting for "
              f"it to end (--wait-for-lock)", file=sys.stderr, flush=True)

    try:
        return hold_save_dir(args.save_dir, wait=args.wait_for_lock, on_wait=waiting)
    except SaveDirInUse as err:
        raise OSError(f"--save-dir {args.save_dir!r} is in use by another live run ({err.holder}): two runs saving "
                      f"into one folder replace each other's checkpoints. Give --wait-for-lock to start when it "
                      f"ends, or choose another --save-dir") from None
