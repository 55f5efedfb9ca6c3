"""One rank of ``infinity deepspeed``: ``import deepspeed`` answered by :mod:`infinity.deepspeed`
(:mod:`~infinity.deepspeed.alias`), ``transformers.Trainer`` and its ``--deepspeed`` JSON by the engine
(:mod:`~infinity.deepspeed.hf_scripts`), then the script run as ``__main__`` with ``--local_rank=N`` appended to
its arguments, as DeepSpeed's launcher passes it (``--no_local_rank``: not appended)::

    python -m infinity.deepspeed.run_script [--no_local_rank] [--module] SCRIPT [ARGS...]

Started by ``torchrun`` (``infinity deepspeed`` does), which sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``.
"""

from __future__ import annotations

import os
import runpy
import sys

from infinity.deepspeed import alias, hf_scripts


def main(argv: list[str]) -> None:
    local_rank, as_module = True, False
    while argv and argv[0] in ("--no_local_rank", "--module"):
        flag = argv.pop(0)
        local_rank = local_rank and flag != "--no_local_rank"
        as_module = as_module or flag == "--module"
    if not argv:
        raise SystemExit("usage: python -m infinity.deepspeed.run_script [--no_local_rank] [--module] SCRIPT [ARGS...]")
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


if __name__ == "__main__":
    main(sys.argv[1:])
