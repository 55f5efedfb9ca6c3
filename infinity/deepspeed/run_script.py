"""One rank of ``infinity deepspeed``: ``import deepspeed`` answered by :mod:`infinity.deepspeed`
(:mod:`~infinity.deepspeed.alias`), ``transformers.Trainer`` and its ``--deepspeed`` JSON by the engine
(:mod:`~infinity.deepspeed.hf_scripts`), then the script run as ``__main__`` with ``--local_rank=N`` appended to
its arguments, as DeepSpeed's launcher passes it (``--no_local_rank``: not appended)::

    python -m infinity.deepspeed.run_script [--no_local_rank] [--module] [--bind_cores=0-3,8] SCRIPT [ARGS...]

Started by ``torchrun`` (``infinity deepspeed`` does), which sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``. ``--bind_cores``: this rank runs on its own contiguous share of those cores
(its ``LOCAL_RANK``-th of ``LOCAL_WORLD_SIZE``), with torch's threads as many, as DeepSpeed's launcher binds a rank
with ``numactl -C`` under ``--bind_cores_to_rank``.
"""

from __future__ import annotations

import os
import runpy
import sys

import torch

from infinity.deepspeed import alias, hf_scripts
from infinity.runtime.comm import local_rank_and_size
from infinity.runtime.host_cores import RANK_BOUND_ENV, cores_named, rank_share

BIND_FLAG = "--bind_cores="


def main(argv: list[str]) -> None:
    local_rank, as_module = True, False
    while argv and (argv[0] in ("--no_local_rank", "--module") or argv[0].startswith(BIND_FLAG)):
        flag = argv.pop(0)
        local_rank = local_rank and flag != "--no_local_rank"
        as_module = as_module or flag == "--module"
        if flag.startswith(BIND_FLAG):
            bind_to_rank_share(cores_named(flag[len(BIND_FLAG):]))
    if not argv:
        raise SystemExit("usage: python -m infinity.deepspeed.run_script [--no_local_rank] [--module] "
                         "[--bind_cores=LIST] SCRIPT [ARGS...]")
    script, args = argv[0], argv[1:]
    if local_rank:
        args.append(f"--local_rank={os.environ.get('LOCAL_RANK', '0')}")
    alias.install()
    hf_scripts.install()  # a Hugging Face script's DeepSpeed JSON is the engine's config, its Trainer ours
    sys.argv = [script, *args]
    if as_module:
        runpy.run_module(script, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` puts its folder first
        runpy.run_path(script, run_name="__main__")


def bind_to_rank_share(cores: list[int]) -> None:
    """Run this process on its rank's share of ``cores``, with torch's threads (and OpenMP's, for what starts them
    later) as many as its cores, and tell the engine its cores are its rank's alone."""
    share = rank_share(sorted(cores), *local_rank_and_size())
    os.sched_setaffinity(0, share)  # this thread, and every thread it starts from now on (torch's, the engine's)
    os.environ["OMP_NUM_THREADS"] = str(len(share))  # torchrun sets 1 for several ranks
    os.environ[RANK_BOUND_ENV] = "1"
    torch.set_num_threads(len(share))


if __name__ == "__main__":
    main(sys.argv[1:])
