"""``infinity deepspeed``: a DeepSpeed training script run unchanged, as DeepSpeed's launcher runs it, with its
``import deepspeed`` answered by :mod:`infinity.deepspeed`::

    infinity deepspeed train.py --deepspeed --deepspeed_config ds.json   # one process per GPU here (one without)
    infinity deepspeed --num_gpus 2 train.py --deepspeed_config ds.json  # two processes (GPUs, or on the CPU)
    infinity deepspeed --module my_pkg.train --deepspeed_config ds.json

Each process gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (``torchrun``
starts them) and ``--local_rank=N`` after the script's arguments, as DeepSpeed's launcher passes it
(``--no_local_rank``: not). One machine; the first process to fail stops the others and gives the exit code.

DeepSpeed's launcher flags mean here what they mean there on one machine: ``--hostfile`` naming this one host
(``localhost slots=2``) gives its slots, ``--bind_cores_to_rank`` / ``--bind_core_list`` give each process its own
share of the cores, ``--enable_each_rank_log DIR`` puts each process's output in files under DIR, and the flags
of DeepSpeed's multi-machine launchers (``--launcher``, ``--launcher_args``, ``--no_ssh_check``, ``--no_ssh``)
have nothing to do. What cannot be done on one machine by this launcher is refused by name before any process
starts.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args as torchrun_args, run as torchrun

from infinity.deepspeed.run_script import BIND_FLAG
from infinity.runtime.host_cores import cores_named, usable_cores

LOCAL_HOSTS = ("localhost", "127.0.0.1")
REFUSED_FLAGS = {
    "force_multi": "it starts the processes through a multi-machine launcher (ssh); this launcher runs them here",
    "no_python": "the script runs in Python, where its `import deepspeed` is answered by the engine",
    "save_pid": "use the process id of `infinity deepspeed` itself (its processes stop with it)",
    "autotuning": "DeepSpeed's autotuner is not part of the engine; `infinity bench` and `infinity estimate` "
                  "measure and size a run",
    "elastic_training": "elastic training is not supported",
    "min_elastic_nodes": "elastic training is not supported",
    "max_elastic_nodes": "elastic training is not supported",
}
"""DeepSpeed launcher flags that cannot mean here what they mean there, with why: refused before any process."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num_gpus", "--num_procs", "--num_accelerators", dest="num_gpus", type=int, default=None,
                   metavar="N",
                   help="processes to start: one per GPU (default: every GPU this machine has; one without a GPU)")
    p.add_argument("-H", "--hostfile", default=None, metavar="PATH",
                   help="DeepSpeed's hostfile (`HOST slots=N`), naming this one machine: its slots are the processes "
                        "(a missing file: this machine's GPUs, as DeepSpeed goes on)")
    p.add_argument("-i", "--include", default=None, metavar="localhost:0,1",
                   help="the GPUs to use, DeepSpeed's way (one process each; sets CUDA_VISIBLE_DEVICES)")
    p.add_argument("-e", "--exclude", default=None, metavar="localhost:2",
                   help="the GPUs not to use, DeepSpeed's way")
    p.add_argument("--num_nodes", type=int, default=1, help="machines (one: the engine's launcher runs on one)")
    p.add_argument("--master_addr", default=None, help="the rendezvous address (default: this machine, a free port)")
    p.add_argument("--master_port", type=int, default=None, help="the rendezvous port (default: a free one)")
    p.add_argument("--no_local_rank", action="store_true", help="do not append --local_rank=N to the script's args")
    p.add_argument("--module", action="store_true", help="SCRIPT is a module to run as `python -m` does")
    p.add_argument("--bind_cores_to_rank", action="store_true",
                   help="each process on its own contiguous share of the cores, its threads as many")
    p.add_argument("--bind_core_list", default=None, metavar="0,2-5",
                   help="the cores to share out (binds, as --bind_cores_to_rank; default: every core this process "
                        "may use)")
    p.add_argument("--enable_each_rank_log", default=None, metavar="DIR",
                   help="each process's stdout and stderr into files under DIR (torchrun's layout: "
                        "DIR/RUN/attempt_0/LOCAL_RANK/stdout.log) instead of this terminal")
    for flag in ("--launcher", "--launcher_args"):
        p.add_argument(flag, default=None, help="DeepSpeed's multi-machine launcher's: nothing to do on one")
    for flag in ("--no_ssh_check", "--no_ssh"):
        p.add_argument(flag, action="store_true", help="DeepSpeed's multi-machine launcher's: nothing to do on one")
    for flag in ("force_multi", "no_python", "save_pid", "elastic_training"):
        p.add_argument(f"--{flag}", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--autotuning", default=None, choices=["tune", "run"], help=argparse.SUPPRESS)
    for flag in ("min_elastic_nodes", "max_elastic_nodes"):
        p.add_argument(f"--{flag}", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("script", metavar="SCRIPT", help="the training script (or module, with --module)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments")


def run(args: argparse.Namespace) -> int:
    for flag, why in REFUSED_FLAGS.items():
        if getattr(args, flag) not in (None, False):
            raise ValueError(f"--{flag}: not offered by `infinity deepspeed`: {why}")
    if args.num_nodes != 1:
        raise ValueError(f"--num_nodes {args.num_nodes}: `infinity deepspeed` starts the processes of one machine; "
                         "on several, start `python -m infinity.deepspeed.run_script SCRIPT ...` on each with torchrun")
    host = _hostfile_host(args.hostfile)
    if host is None:
        gpus = _chosen_gpus(args.include, args.exclude, torch.cuda.device_count())
    else:
        name, slots = host
        if torch.cuda.is_available() and slots > torch.cuda.device_count():
            raise ValueError(f"--hostfile {args.hostfile}: {name} slots={slots}, but this machine has "
                             f"{torch.cuda.device_count()} GPU(s)")
        gpus = _chosen_gpus(args.include, args.exclude, slots, hosts=(*LOCAL_HOSTS, name))
        if gpus is None and args.num_gpus is not None and args.num_gpus > slots:
            raise ValueError(f"--num_gpus {args.num_gpus} but --hostfile {args.hostfile} gives {name} slots={slots}")
        if gpus is None:
            gpus = list(range(slots if args.num_gpus is None else args.num_gpus))  # DeepSpeed's: the first N slots
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
    if args.bind_cores_to_rank or args.bind_core_list is not None:
        flags.append(BIND_FLAG + ",".join(map(str, _cores_to_bind(args.bind_core_list, processes))))
    logs = [] if args.enable_each_rank_log is None else ["--log-dir", args.enable_each_rank_log, "--redirects", "3"]
    argv = [*rendezvous, "--nnodes", "1", "--nproc_per_node", str(processes), *logs, "-m",
            "infinity.deepspeed.run_script", *flags, args.script, *args.script_args]
    try:
        torchrun(torchrun_args(argv))
    except ChildFailedError as err:
        _, first = min(err.failures.items(), key=lambda item: item[1].timestamp)
        return first.exitcode if first.exitcode > 0 else 1
    return 0


def _hostfile_host(path: str | None) -> tuple[str, int] | None:
    """(host, slots) of DeepSpeed's hostfile at ``path`` (lines ``HOST slots=N``; ``#`` comments), which must name
    one machine; None where no hostfile is given, or where it is missing (DeepSpeed's launcher then goes on with this
    machine's own GPUs, and so does this one, saying so). Raises ``ValueError`` naming the file and the line."""
    if path is None:
        return None
    if not os.path.isfile(path):
        print(f"infinity deepspeed: no hostfile at {path}: going on with this machine's resources only",
              file=sys.stderr)
        return None
    hosts: dict[str, int] = {}
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            match = re.match(r"^(\S+)\s+slots=(\d+)", line)
            if match is None or match.group(1) in hosts:
                why = "is not `HOST slots=N`" if match is None else "names a host a second time"
                raise ValueError(f"--hostfile {path}: line {number} ({line!r}) {why}")
            hosts[match.group(1)] = int(match.group(2))
    if len(hosts) != 1:
        raise ValueError(f"--hostfile {path}: names {len(hosts)} hosts ({', '.join(hosts) or 'none'}): "
                         "`infinity deepspeed` starts the processes of one machine")
    (name, slots), = hosts.items()
    if slots < 1:
        raise ValueError(f"--hostfile {path}: {name} slots={slots}: at least one slot")
    return name, slots


def _cores_to_bind(listed: str | None, processes: int) -> list[int]:
    """The cores ``--bind_cores_to_rank`` shares out among ``processes``: ``--bind_core_list`` (each one this
    process may use) or every core this process may use; at least one for each process."""
    usable = usable_cores()
    try:
        cores = sorted(usable) if listed is None else cores_named(listed)
    except ValueError as err:
        raise ValueError(f"--bind_core_list {err}") from None
    outside = [core for core in cores if core not in usable]
    if outside:
        raise ValueError(f"--bind_core_list {listed}: this process may not run on core(s) {outside} "
                         f"(it may on {len(usable)}: {sorted(usable)})")
    if len(cores) < processes:
        raise ValueError(f"--bind_cores_to_rank: {len(cores)} core(s) for {processes} processes: at least one each")
    return cores


def _chosen_gpus(include: str | None, exclude: str | None, count: int,
                 hosts: tuple[str, ...] = LOCAL_HOSTS) -> list[int] | None:
    """The GPU indices ``--include`` / ``--exclude`` leave (``localhost:0,1``; ``localhost`` alone: all of them),
    or None where neither is given. ``hosts``: the names of this machine (with a hostfile, its host's too)."""
    if include is None and exclude is None:
        return None
    if include is not None and exclude is not None:
        raise ValueError("--include and --exclude: give one")

    def indices(flag: str, value: str) -> list[int]:
        host, _, listed = value.partition(":")
        if host not in hosts or "@" in value:
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
