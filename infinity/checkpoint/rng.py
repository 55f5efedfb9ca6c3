"""The random number generators' state: captured into each rank's shard file, restored from it.

torch's CPU generator (and the current GPU's, where CUDA is initialized) are
tensors of the file (``rng/torch``, ``rng/cuda``); Python's and numpy's states
are JSON in the file's header (``rng``), so loading never unpickles.
"""

from __future__ import annotations

import json
import random
from typing import Any

import torch

from infinity.checkpoint.safetensors_io import CheckpointError, SafetensorsReader

METADATA_KEY = "rng"
"""The header entry that holds the Python and numpy states."""


def capture() -> tuple[dict[str, torch.Tensor], dict]:
    """This process's generators: the tensors to file by name, and the JSON state for the header."""
    tensors = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss_next]}
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return tensors, state


def restore(reader: SafetensorsReader) -> None:
    """Set this process's generators to the state filed in ``reader``'s file."""
    torch.set_rng_state(reader.read("rng/torch"))
    if "rng/cuda" in reader.tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(reader.read("rng/cuda"))
    try:
        state = json.loads(reader.metadata.get(METADATA_KEY, "{}"))
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
        if "numpy" in state:
            import numpy as np
            s = state["numpy"]
            np.random.set_state((s["kind"], np.array(s["keys"], dtype=np.uint32), s["pos"], s["has_gauss"],
                                 s["cached_gaussian"]))
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint file {reader.path}: bad RNG state ({err})") from None
