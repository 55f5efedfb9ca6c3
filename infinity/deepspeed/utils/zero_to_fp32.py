"""``deepspeed.utils.zero_to_fp32`` over the engine's checkpoints: the trained model's fp32 state dict from a save
folder, in memory (``get_fp32_state_dict_from_zero_checkpoint``), loaded into a plain model
(``load_state_dict_from_zero_checkpoint``) or written as weight files (``convert_zero_checkpoint_to_fp32_state_dict``).
No engine and no process group are needed: the ranks' shard files are read directly, whatever the world size was.

``exclude_frozen_parameters``: the trained parameters (and buffers) only; a checkpoint saved without its frozen
parameters (a LoRA run's) gives those and nothing else. ``infinity consolidate`` does the same from the command
line, a tensor at a time.

Run as a script it takes DeepSpeed's ``zero_to_fp32.py`` arguments (:func:`main`): the DeepSpeed door and the
Trainer write a ``zero_to_fp32.py`` that calls it into each save folder, where DeepSpeed writes its own
(:mod:`infinity.checkpoint.recovery_script`), so ``python zero_to_fp32.py . OUTPUT`` works there as it does after
a DeepSpeed run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from infinity.checkpoint.consolidation import checkpoint_state_dict, consolidated_outputs
from infinity.checkpoint.publish import resolve_checkpoint, write_state_dict_atomic
from infinity.checkpoint.reader import Checkpoint
from infinity.config.units import parse_nbytes
from infinity.weights.export import HFTensor, write_hf_folder

WEIGHT_FILE_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors")
"""An output path with one of these is a single file (DeepSpeed's older ``output_file``); else it is a folder."""


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, torch.Tensor]:
    """The plain model's fp32 state dict (host tensors) from ``checkpoint_dir`` (a save folder, ``tag`` or its
    ``latest``). ``lazy_mode`` is accepted: the tensors are read already (``.contiguous()`` returns each)."""
    return checkpoint_state_dict(checkpoint_dir, tag=tag, trainable_only=exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag: str | None = None):
    """``model`` on the CPU with the checkpoint's fp32 values loaded (``strict``: every key must match); returns
    it. The model is then a plain one: give it to ``initialize`` again to go on training."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> dict:
    """Write the checkpoint's fp32 state dict into ``output_dir``: shards of at most ``max_shard_size`` with their
    index, as transformers names them (``safe_serialization``: ``model.safetensors``, or
    ``model-00001-of-00002.safetensors``... and ``model.safetensors.index.json``; else ``pytorch_model.bin``...), a
    tensor at a time for safetensors. An ``output_dir`` ending in
    ``.bin``, ``.pt``, ``.pth`` or ``.safetensors`` is one file (DeepSpeed's older ``output_file``). The output
    appears whole or not at all; a folder's files that are not a model's are kept."""
    out = Path(output_dir)
    max_shard_nbytes = parse_nbytes(max_shard_size, "max_shard_size")
    if out.suffix in WEIGHT_FILE_SUFFIXES:
        return _write_one_file(checkpoint_dir, out, tag=tag, trainable_only=exclude_frozen_parameters)
    ckpt = Checkpoint(resolve_checkpoint(checkpoint_dir, tag))
    try:
        ckpt.verify()
        tensors = [HFTensor(name, tuple(o.shape), o.dtype, o.fill)
                   for o in consolidated_outputs(ckpt, torch.float32, trainable_only=exclude_frozen_parameters)
                   for name in o.names]
        summary = write_hf_folder(out, tensors, max_shard_nbytes=max_shard_nbytes,
                                  weights_format="safetensors" if safe_serialization else "bin",
                                  one_file_unindexed=True)
    finally:
        ckpt.close()
    return dict(summary, checkpoint=str(ckpt.path), global_step=ckpt.meta["global_step"])


def _write_one_file(checkpoint_dir, out: Path, *, tag: str | None, trainable_only: bool) -> dict:
    if out.is_dir():
        raise IsADirectoryError(f"convert_zero_checkpoint_to_fp32_state_dict: {out} is a folder; name a file or "
                                "give the folder without a weight-file suffix")
    state = checkpoint_state_dict(checkpoint_dir, tag=tag, trainable_only=trainable_only)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_state_dict_atomic(out, state)
    return {"path": str(out), "tensors": len(state)}


def main(argv=None, prog: str | None = None) -> int:
    """DeepSpeed's ``zero_to_fp32.py`` command line: ``CHECKPOINT_DIR OUTPUT_DIR`` (or an output file ending in
    ``.bin``/``.pt``/``.pth``/``.safetensors``), ``--max_shard_size``, ``--safe_serialization``, ``-t/--tag``,
    ``--exclude_frozen_parameters``, ``-d/--debug``."""
    parser = argparse.ArgumentParser(
        prog=prog, description="The trained model's fp32 weights from a zero-infinity save folder, as DeepSpeed's "
                               "zero_to_fp32.py writes them (the same as `infinity consolidate`).")
    parser.add_argument("checkpoint_dir", help="the save folder (its 'latest' names the checkpoint), or a "
                                               "checkpoint's own folder, e.g. path/checkpoint-12")
    parser.add_argument("output_dir", help="the folder for the weight files (transformers' names), or one file "
                                           "ending in " + "/".join(WEIGHT_FILE_SUFFIXES))
    parser.add_argument("--max_shard_size", default="5GB", help="the largest weight file (default 5GB)")
    parser.add_argument("--safe_serialization", action="store_true", help="safetensors files (else .bin)")
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint to read (default: the one 'latest' names)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="the trained parameters only (a LoRA run's adapters)")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted, as DeepSpeed's (no extra output)")
    args = parser.parse_args(argv)
    try:
        summary = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir, args.output_dir, max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization, tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters)
    except (OSError, ValueError) as error:  # a missing or damaged checkpoint, an output that cannot be written
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    written = summary.get("path") or args.output_dir
    print(f"wrote the fp32 weights of {summary.get('checkpoint', Path(args.checkpoint_dir).resolve())} to {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
