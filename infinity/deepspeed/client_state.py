"""A DeepSpeed script's ``client_state``, kept as DeepSpeed keeps it: whatever ``torch.save`` can store (tensors,
tuples, numpy values, nested dicts), returned by ``load_checkpoint`` as it was given.

The engine's checkpoint keeps ``client_state`` in its ``meta.json`` (published atomically with the shard files), so
the door stores there the bytes of ``torch.save(client_state)``, in base64 under :data:`SAVED_KEY`. A checkpoint
written before (its ``client_state`` plain JSON) loads as it was saved. Loading unpickles, as DeepSpeed's
``torch.load`` of its own checkpoint files does: load only checkpoints you trust.
"""

from __future__ import annotations

import base64
import io

import torch

SAVED_KEY = "deepspeed_client_state_torch_save_base64"
"""The one key of the engine's ``client_state`` in a checkpoint the door wrote: ``torch.save``'s bytes, base64."""


def encode(client_state: dict) -> dict:
    """``client_state`` as the engine's checkpoint stores it; ``ValueError`` naming the first key whose value
    ``torch.save`` cannot store (before any file is written)."""
    if not isinstance(client_state, dict):
        raise ValueError(f"save_checkpoint(client_state=...) must be a dict, got {type(client_state).__name__}")
    try:
        saved = _saved_bytes(client_state)
    except Exception as err:
        where = _first_unsaveable(client_state, "client_state")
        raise ValueError(f"save_checkpoint(client_state=...): {where} cannot be stored by torch.save ({err}); "
                         f"nothing was written") from err
    return {SAVED_KEY: base64.b64encode(saved).decode("ascii")}


def decode(stored: dict) -> dict:
    """What :func:`encode` stored, as it was given; a checkpoint's plain JSON ``client_state`` as it is."""
    if set(stored) != {SAVED_KEY}:
        return stored  # written before the door stored client_state with torch.save
    return torch.load(io.BytesIO(base64.b64decode(stored[SAVED_KEY])), map_location="cpu", weights_only=False)


def _saved_bytes(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _first_unsaveable(value, where: str) -> str:
    """The path (``client_state['a'][2]``) of the innermost part of ``value`` that ``torch.save`` refuses."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        try:
            _saved_bytes(item)
        except Exception:
            return _first_unsaveable(item, f"{where}[{key!r}]")
    return where
