"""``infinity consolidate``: one state dict from a sharded checkpoint.

    infinity consolidate runs/ckpt model.safetensors              # the `latest` checkpoint, fp32
    infinity consolidate runs/ckpt/step1000 model.safetensors --dtype bf16

The output is a safetensors file under the model's original parameter names
(tied parameters under each of their names, tiled layers as the dense
tensors), with the persistent buffers, loadable by ``model.load_state_dict``
after ``safetensors.torch.load_file``. It is written one tensor at a time, so
memory peaks at about the largest tensor, not the model.
"""

from __future__ import annotations

import argparse
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CKPT",
                   help="a checkpoint folder, or a save folder (its `latest` checkpoint, or --tag)")
    p.add_argument("out", metavar="OUT.safetensors", help="the file to write (replaced atomically)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="dtype of floating tensors (default fp32)")
    p.add_argument("--tag", default=None, help="which checkpoint of a save folder (default: its `latest`)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip checking the shard files' sha256 (they are read twice otherwise)")


def run(args: argparse.Namespace) -> int:
    from infinity.consolidation import consolidate

    started = time.perf_counter()
    summary = consolidate(args.checkpoint, args.out, dtype=args.dtype, tag=args.tag, verify=args.verify)
    print(f"wrote {summary['path']}: {summary['tensors']} tensors, {summary['nbytes'] / 2**20:,.1f} MiB {args.dtype} "
          f"(largest {summary['largest_tensor_nbytes'] / 2**20:,.1f} MiB) from {summary['checkpoint']} "
          f"(step {summary['global_step']}, {summary['world_size']} rank(s)) in {time.perf_counter() - started:.1f} s")
    return 0
