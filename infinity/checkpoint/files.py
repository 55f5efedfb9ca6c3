"""A checkpoint's files: their names, and ``meta.json`` written and read with its own sha256."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from infinity.checkpoint.safetensors_io import CheckpointError

FORMAT = "infinity-checkpoint"
VERSION = 1
META_FILE = "meta.json"


def shard_file(rank: int, world_size: int) -> str:
    """The name of rank ``rank``'s file in a checkpoint saved by ``world_size`` ranks."""
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def is_checkpoint_folder(folder) -> bool:
    """Whether ``folder`` holds a checkpoint: a ``meta.json`` of our format, or one beside rank shard files (a
    damaged checkpoint is still one). Outputs are never written there: they would replace its files."""
    folder = Path(folder)
    meta = folder / META_FILE
    if not meta.is_file():
        return False
    try:
        body = json.loads(meta.read_bytes())
        if isinstance(body, dict) and body.get("format") == FORMAT:
            return True
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        pass
    return any(folder.glob("shard-*-of-*.safetensors"))


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def write_meta(path: Path, body: dict) -> None:
    """Write ``body`` and its checksum to the new file ``path``, and fsync it (the folder is the caller's)."""
    meta = dict(body, checksum=hashlib.sha256(_canonical(body)).hexdigest())
    with open(path, "x") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_meta(checkpoint: Path) -> dict:
    """``meta.json`` of a checkpoint folder, checked against its own sha256 and our format version."""
    path = Path(checkpoint) / META_FILE
    try:
        meta = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint file {path} is damaged: not valid JSON ({err})") from None
    if not isinstance(meta, dict) or "checksum" not in meta:
        raise CheckpointError(f"checkpoint file {path} is damaged or not ours: no checksum")
    checksum = meta.pop("checksum")
    if hashlib.sha256(_canonical(meta)).hexdigest() != checksum:
        raise CheckpointError(f"checkpoint file {path} is damaged: its content does not match its checksum")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint file {path} is not an {FORMAT} (format {meta.get('format')!r})")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"checkpoint file {path} has format version {meta.get('version')!r}; this build "
                              f"reads version {VERSION}")
    return meta
