"""``deepspeed.utils``' ``logger`` and ``log_dist``: a script's messages on the ranks it names, as DeepSpeed's.

DeepSpeed's logger prints its INFO lines itself, to stdout, in its own format, and does not pass them on to the
root logger: a script that logs its progress through it (``log_dist(f"step {n} loss {loss}", ranks=[0])``) shows
it with no logging set up, once however the script configures logging. This one does the same.
"""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist

FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"
"""DeepSpeed's logger's format."""


class _Stdout(logging.StreamHandler):
    """A handler writing to ``sys.stdout`` as it is when a line is logged (a script, a notebook or a test may have
    replaced it since this module was imported)."""

    def __init__(self):
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        """Kept as ``sys.stdout`` (``StreamHandler.__init__`` and ``setStream`` assign it)."""


logger = logging.getLogger("DeepSpeed")
"""DeepSpeed's logger, by DeepSpeed's name: INFO and up to stdout, not passed on to the root logger."""
if not any(isinstance(handler, _Stdout) for handler in logger.handlers):
    _handler = _Stdout()
    _handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # printed once, whatever handlers the script gives the root logger


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """``message`` on :data:`logger` at ``level`` as ``[Rank r] message``, as DeepSpeed's: in a process without a
    process group always (r is -1 there); else on the ranks in ``ranks`` (``[-1]``: every rank; None: none)."""
    if dist.is_initialized():
        rank = dist.get_rank()
        ranks = ranks or []
        if not ranks or (ranks[0] != -1 and rank not in ranks):
            return
    else:
        rank = -1
    logger.log(level, "[Rank %d] %s", rank, message)
