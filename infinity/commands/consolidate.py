"""``infinity consolidate``: one state dict from a sharded checkpoint.

    infinity consolidate runs/ckpt model.safetensors              # the `latest` checkpoint, fp32
    infinity consolidate runs/ckpt/step1000 model.safetensors --dtype bf16
    infinity consolidate runs/ckpt tuned-llama/ --hf [--hf-config my-llama/]   # AutoModelForCausalLM loads it
    infinity consolidate runs/lora-ckpt adapters/ --hf    # a --lora-rank run's: its adapters, as peft writes them

The output is a safetensors file under the model's original parameter names
(tied parameters under each of their names, tiled layers as the dense
tensors), with the persistent buffers, loadable by ``model.load_state_dict``
after ``safetensors.torch.load_file``. It is written one tensor at a time, so
memory peaks at about the largest tensor, not the model.
"""

from __future__ import annotations

import argparse
import time

from infinity.checkpoint.consolidation import consolidate
from infinity.commands.train_outputs import check_model_folder
from infinity.hf.checkpoint_adapters import checkpoint_records_adapters, consolidate_adapters
from infinity.placement.report import format_bytes
from infinity.weights.export import consolidate_hf


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CKPT",
                   help="a checkpoint folder, or a save folder (its `latest` checkpoint, or --tag)")
    p.add_argument("out", metavar="OUT.safetensors", help="the file to write (replaced atomically); with --hf a folder")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="dtype of floating tensors (default fp32; fp16 only with --hf)")
    p.add_argument("--hf", action="store_true",
                   help="write the Hugging Face layout into the folder OUT: sharded safetensors, "
                        "model.safetensors.index.json and config.json")
    p.add_argument("--hf-config", metavar="DIR",
                   help="with --hf: the model folder whose config.json to use (default: the one the run recorded)")
    p.add_argument("--overwrite", action="store_true",
                   help="with --hf: replace the model in an OUT folder that holds one (refused without it; the "
                        "folder's other files stay)")
    p.add_argument("--tag", default=None, help="which checkpoint of a save folder (default: its `latest`)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip checking the shard files' sha256 (they are read twice otherwise)")


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if args.hf:
        check_model_folder("OUT", args.out, overwrite=args.overwrite)  # before reading a byte of the checkpoint
        if checkpoint_records_adapters(args.checkpoint, args.tag):
            if args.hf_config:
                raise ValueError("--hf-config: a LoRA checkpoint is written as its adapters, which need no config.json")
            s = consolidate_adapters(args.checkpoint, args.out, dtype=args.dtype, tag=args.tag, verify=args.verify)
            print(f"wrote {s['path']} (peft's layout: adapter_config.json, adapter_model.safetensors): {s['tensors']} "
                  f"adapter tensors, {format_bytes(s['nbytes'])} {args.dtype} from {s['checkpoint']} (step "
                  f"{s['global_step']}, {s['world_size']} rank(s); the base was not saved in it) in "
                  f"{time.perf_counter() - started:.1f} s")
            return 0
        s = consolidate_hf(args.checkpoint, args.out, dtype=args.dtype, tag=args.tag, verify=args.verify,
                           config_dir=args.hf_config)
        print(f"wrote {s['path']} (Hugging Face layout): {s['tensors']} tensors in {s['files']} file(s), "
              f"{s['nbytes'] / 2**20:,.1f} MiB {args.dtype} from {s['checkpoint']} (step {s['global_step']}, "
              f"{s['world_size']} rank(s)) in {time.perf_counter() - started:.1f} s")
        return 0
    if args.hf_config:
        raise ValueError("--hf-config needs --hf")
    if args.overwrite:
        raise ValueError("--overwrite needs --hf (a single OUT file is always replaced atomically)")
    if args.dtype == "fp16":
        raise ValueError("--dtype fp16 needs --hf (a single OUT file is fp32 or bf16)")
    summary = consolidate(args.checkpoint, args.out, dtype=args.dtype, tag=args.tag, verify=args.verify)
    print(f"wrote {summary['path']}: {summary['tensors']} tensors, {summary['nbytes'] / 2**20:,.1f} MiB {args.dtype} "
          f"(largest {summary['largest_tensor_nbytes'] / 2**20:,.1f} MiB) from {summary['checkpoint']} "
          f"(step {summary['global_step']}, {summary['world_size']} rank(s)) in {time.perf_counter() - started:.1f} s")
    return 0

