"""What saving a trained model writes: the whole model in the Hugging Face layout (:mod:`infinity.weights.export`),
or, for a ``peft`` model, its adapters as ``peft_model.save_pretrained`` writes them (:mod:`infinity.weights.adapters`;
:func:`infinity.hf.merge.save_merged` writes the base with them merged). Collective: every rank calls it."""

from __future__ import annotations

import torch

from infinity.checkpoint.shard_source import ShardSource
from infinity.weights.adapters import is_peft_model, save_adapters
from infinity.weights.export import DEFAULT_MAX_SHARD_NBYTES, save_pretrained


def save_model(source: ShardSource, model: torch.nn.Module, out_dir, *, dtype="fp32",
               max_shard_nbytes: int | None = None, one_file_unindexed: bool = False) -> dict:
    """Write ``model`` (rank 0 writes); a summary: ``path``, ``tensors``, ``files``, ``nbytes``, and ``adapters``
    (True where only a ``peft`` model's adapters were written). ``one_file_unindexed``: a whole model that fits one
    shard is ``model.safetensors`` without an index, as transformers writes it."""
    if is_peft_model(model):
        count, nbytes = save_adapters(source, model, out_dir, dtype=dtype, write=source.comm.rank == 0)
        return {"path": str(out_dir), "tensors": count, "files": 1, "nbytes": nbytes, "adapters": True}
    return save_pretrained(source, model, out_dir, dtype=dtype,
                           max_shard_nbytes=max_shard_nbytes or DEFAULT_MAX_SHARD_NBYTES,
                           one_file_unindexed=one_file_unindexed)
