"""``infinity deepspeed``: a DeepSpeed training script run unchanged, as DeepSpeed's launcher runs it, with its
``import deepspeed`` answered by :mod:`infinity.deepspeed`::

    infinity deepspeed train.py --deepspeed --deepspeed_config ds.json   # one process per GPU here (one without)
    infinity deepspeed --num_gpus 2 train.py --deepspeed_config ds.json  # two processes (GPUs, or on the CPU)
    infinity deepspeed --module my_pkg.train --deepspeed_config ds.json

Each process gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (``torchrun``
starts them) and ``--local_rank=N`` after the script's arguments, as DeepSpeed's launcher passes it
(``--no_local_rank``: not). One machine; the first process to fail stops the others and gives the exit code.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args as torchrun_args, run as torchrun


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num_gpus", "--num_procs", dest="num_gpus", type=int, default=None, metavar="N",
                   help="processes to start: one per GPU (default: every GPU this machine has; one without a GPU)")
    p.add_argument("--include", default=None, metavar="localhost:0,1",
                   help="the GPUs to use, DeepSpeed's way (one process each; sets CUDA_VISIBLE_DEVICES)")
    p.add_argument("--exclude", default=None, metavar="localhost:2", help="the GPUs not to use, DeepSpeed's way")
    p.add_argument("--num_nodes", type=int, default=1, help="machines (one: the engine's launcher runs on one)")
    p.add_argument("--master_addr", default=None, help="the rendezvous address (default: this machine, a free port)")
    p.add_argument("--master_port", type=int, default=None, help="the rendezvous port (default: a free one)")
    p.add_argument("--no_local_rank", action="store_true", help="do not append --local_rank=N to the script's args")
    p.add_argument("--module", action="store_true", help="SCRIPT is a module to run as `python -m` does")
    p.add_argument("script", metavar="SCRIPT", help="the training script (or module, with --module)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments")


def run(args: argparse.Namespace) -> int:
    if args.num_nodes != 1:
        raise ValueError(f"--num_nodes {args.num_nodes}: `infinity deepspeed` starts the processes of one machine; "
                         "on several, start `python -m infinity.deepspeed.run_script SCRIPT ...` on each with torchrun")
    gpus = _chosen_gpus(args.include, args.exclude, torch.cuda.device_count())
    if gpus is not None:
        if args.num_gpus is not None and args.num_gpus != len(gpus):
            raise ValueError(f"--num_gpus {args.num_gpus} but --include/--exclude leave {len(gpus)} GPU(s)")
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))  # the processes inherit it
    processes = len(gpus) if gpus is not None else (args.num_gpus if args.num_gpus is not None
                                                     else max(1, torch.cuda.device_count()))
    if processes < 1:
        raise ValueError(f"--num_gpus {processes}: at least one process")
    if torch.cuda.is_available() and processes > torch.cuda.device_count():
        raise ValueError(f"--num_gpus {processes}: this machine has {torch.cuda.device_count()} GPU(s)")
    if not args.module and not Path(args.script).is_file():
        raise FileNotFoundError(f"{args.script}: no such script (with --module, a module name)")
    if args.master_addr is None and args.master_port is None:
        rendezvous = ["--standalone"]  # this machine, a free port
    else:
        rendezvous = ["--master_addr", args.master_addr or "127.0.0.1", "--master_port", str(args.master_port or 29500)]
    flags = [flag for flag, on in (("--no_local_rank", args.no_local_rank), ("--module", args.module)) if on]
    argv = [*rendezvous, "--nnodes", "1", "--nproc_per_node", str(processes), "-m", "infinity.deepspeed.run_script",
            *flags, args.script, *args.script_args]
    try:
        torchrun(torchrun_args(argv))
    except ChildFailedError as err:
        _, first = min(err.failures.items(), key=lambda item: item[1].timestamp)
        return first.exitcode if first.exitcode > 0 else 1
    return 0


def _chosen_gpus(include: str | None, exclude: str | None, count: int) -> list[int] | None:
    """The GPU indices ``--include`` / ``--exclude`` leave (``localhost:0,1``; ``localhost`` alone: all of them),
    or None where neither is given."""
    if include is None and exclude is None:
        return None
    if include is not None and exclude is not None:
        raise ValueError("--include and --exclude: give one")

    def indices(flag: str, value: str) -> list[int]:
        host, _, listed = value.partition(":")
        if host not in ("localhost", "127.0.0.1") or "@" in value:
            raise ValueError(f"{flag} {value}: one machine only, as localhost[:i,j,...]")
        try:
            chosen = [int(i) for i in listed.split(",")] if listed else list(range(count))
        except ValueError:
            raise ValueError(f"{flag} {value}: GPU indices are integers (localhost:0,1)") from None
        unknown = [i for i in chosen if not 0 <= i < count]
        if unknown:
            raise ValueError(f"{flag} {value}: no GPU {unknown} on this machine ({count} GPU(s))")
        return chosen

    if include is not None:
        return indices("--include", include)
    excluded = set(indices("--exclude", exclude))
    return [i for i in range(count) if i not in excluded]
