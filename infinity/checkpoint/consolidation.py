"""``infinity consolidate``: one state dict under the original names, from a sharded checkpoint.

Streaming: each dense tensor is assembled from the ranks' shard files and
written before the next is read, so peak memory is about the largest tensor.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import sys
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from infinity.checkpoint.files import is_checkpoint_folder
from infinity.checkpoint.publish import LATEST_FILE, TMP_PREFIX, fsync_dir, resolve_checkpoint
from infinity.checkpoint.reader import Checkpoint
from infinity.checkpoint.safetensors_io import CheckpointError, SafetensorsWriter

CONSOLIDATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROGRESS_AFTER_S = 2.0
"""A consolidation shows a progress bar once it has taken this long."""


@dataclasses.dataclass
class ConsolidatedTensor:
    """One tensor of the consolidated file, written under each of ``names``."""

    names: list[str]
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: Callable[[torch.Tensor], None]


def consolidated_outputs(ckpt: Checkpoint, dtype: torch.dtype, *,
                         trainable_only: bool = False) -> list[ConsolidatedTensor]:
    """The tensors of the plain model's state dict, in order, each with the way to fill it from the shards
    (``trainable_only``: its trained parameters and its buffers, as a checkpoint saved without its frozen
    parameters holds them)."""
    meta = ckpt.meta
    if meta.get("frozen_excluded") and not trainable_only:
        raise CheckpointError(f"checkpoint {ckpt.path} was saved without its frozen parameters "
                              f"(exclude_frozen_parameters): it holds only those that train, not a whole model; load "
                              f"it into its run (engine.load_checkpoint, or --resume) and write the model from there "
                              f"(save_pretrained: a peft model's adapters); an `infinity train --lora-rank` run's "
                              f"checkpoint gives its adapters with `infinity consolidate --hf`; its trained tensors "
                              f"alone: exclude_frozen_parameters=True (zero_to_fp32.py --exclude_frozen_parameters)")
    slot_of = {alias: p["name"] for p in meta["params"] for alias in p["names"]}

    def param_fill(p: dict):
        kind = "master" if p["trainable"] else "param"
        return lambda out: ckpt.read_range(kind, p, 0, out.view(-1))

    tiled: dict[str, dict] = {}  # tile name -> its dense tensor's entry
    for dense in meta.get("tiling") or []:
        for tile in dense["tiles"]:
            tiled[tile["name"]] = dense
    outputs: list[ConsolidatedTensor] = []
    emitted_dense: set[str] = set()
    for p in meta["params"]:
        if trainable_only and not p["trainable"]:
            continue
        plain = [n for n in p["names"] if n not in tiled]
        if plain:
            outputs.append(ConsolidatedTensor(plain, tuple(p["shape"]), dtype, param_fill(p)))
        for alias in p["names"]:
            dense = tiled.get(alias)
            if dense is None or dense["name"] in emitted_dense:
                continue
            emitted_dense.add(dense["name"])
            missing = [t["name"] for t in dense["tiles"] if t["name"] not in slot_of]
            if missing:
                raise CheckpointError(f"checkpoint {ckpt.path}: tiles {missing} of {dense['name']!r} are not saved")
            outputs.append(ConsolidatedTensor([dense["name"]], tuple(dense["shape"]), dtype,
                                   _dense_fill(ckpt, dense, slot_of)))
    for b in meta["buffers"]:
        if not b["persistent"]:
            continue
        saved_dtype = getattr(torch, b["dtype"])
        out_dtype = dtype if saved_dtype.is_floating_point else saved_dtype
        outputs.append(ConsolidatedTensor([b["name"]], tuple(b["shape"]), out_dtype,
                               lambda out, n=b["name"]: ckpt.reader(0).read_into(f"buffer/{n}", out)))
    return outputs


def _dense_fill(ckpt: Checkpoint, dense: dict, slot_of: dict[str, str]):
    def fill(out: torch.Tensor) -> None:
        for tile in dense["tiles"]:
            p = ckpt.params[slot_of[tile["name"]]]
            values = torch.empty(p["numel"], dtype=torch.float32)
            ckpt.read_range("master" if p["trainable"] else "param", p, 0, values)
            rows = slice(*tile["rows"])
            index = (rows,) if tile["cols"] is None else (rows, slice(*tile["cols"]))
            out[index].copy_(values.view(p["shape"]))
            del values
    return fill


def progress_bar(total_nbytes: int) -> tqdm:
    """The bytes written so far, on stderr, once writing has taken ``PROGRESS_AFTER_S`` (as ``infinity train`` shows
    its steps); nothing for a quick one."""
    return tqdm(total=total_nbytes, unit="B", unit_scale=True, unit_divisor=1024, desc="consolidating",
                delay=PROGRESS_AFTER_S, leave=False, file=sys.stderr, dynamic_ncols=True)


def checkpoint_state_dict(checkpoint, *, tag: str | None = None, trainable_only: bool = False,
                          verify: bool = True) -> dict[str, torch.Tensor]:
    """The plain model's fp32 state dict from a sharded checkpoint, in host memory (the names a parameter is tied
    under share one tensor); ``checkpoint`` as :func:`consolidate` takes it."""
    ckpt = Checkpoint(resolve_checkpoint(checkpoint, tag))
    try:
        if verify:
            ckpt.verify()
        state: dict[str, torch.Tensor] = {}
        for o in consolidated_outputs(ckpt, torch.float32, trainable_only=trainable_only):
            value = torch.empty(o.shape, dtype=o.dtype)
            o.fill(value)
            state.update(dict.fromkeys(o.names, value))
        return state
    finally:
        ckpt.close()


def consolidate(checkpoint, out_path, *, dtype: str = "fp32", tag: str | None = None,
                verify: bool = True) -> dict:
    """Write one safetensors state dict of the plain model (original names, tied names, persistent buffers)
    from a sharded checkpoint, one tensor at a time: peak memory is about the largest tensor.

    ``checkpoint`` is a save folder (``tag`` or its ``latest``) or a checkpoint folder.
    The output is written to a temporary file and renamed into place.
    """
    if dtype not in CONSOLIDATE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(CONSOLIDATE_DTYPES)}, got {dtype!r}")
    out_path = Path(out_path)
    if out_path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "the output is a folder; name a .safetensors file", str(out_path))
    if is_checkpoint_folder(out_path.absolute().parent) or (out_path.name == LATEST_FILE and out_path.exists()):
        # (the rename into place would replace a shard, meta.json or `latest`: the checkpoint would be lost)
        raise FileExistsError(errno.EEXIST, "the output is inside a checkpoint folder (or is a save folder's `latest`): "
                                            "it could replace the checkpoint's own files; write it elsewhere",
                              str(out_path))
    ckpt = Checkpoint(resolve_checkpoint(checkpoint, tag))
    tmp = out_path.with_name(f".{out_path.name}{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}")
    try:
        if verify:
            ckpt.verify()
        outputs = consolidated_outputs(ckpt, CONSOLIDATE_DTYPES[dtype])
        entries = [(name, o.dtype, o.shape) for o in outputs for name in o.names]
        metadata = {"format": "pt", "source": str(ckpt.path), "global_step": str(ckpt.meta["global_step"])}
        largest = 0
        bar = progress_bar(sum(math.prod(o.shape) * o.dtype.itemsize for o in outputs))
        with SafetensorsWriter(tmp, entries, metadata) as writer:
            for o in outputs:
                value = torch.empty(o.shape, dtype=o.dtype)
                o.fill(value)
                for name in o.names:
                    writer.write(name, value)
                largest = max(largest, value.numel() * value.element_size())
                bar.update(value.numel() * value.element_size())
                del value
            _, nbytes = writer.close()
        bar.close()
        os.replace(tmp, out_path)
        fsync_dir(out_path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        ckpt.close()
    return {"path": str(out_path), "tensors": len(entries), "nbytes": nbytes, "largest_tensor_nbytes": largest,
            "dtype": dtype, "checkpoint": str(ckpt.path), "global_step": ckpt.meta["global_step"],
            "world_size": ckpt.world_size}
