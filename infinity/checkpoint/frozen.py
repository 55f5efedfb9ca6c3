"""The frozen parameters' compute shards on this rank, fingerprinted, so that a checkpoint may leave them out.

A frozen parameter (a LoRA base) never changes in a run. A checkpoint saved with
``exclude_frozen_parameters`` (DeepSpeed's name) holds none of them, so a LoRA checkpoint is the adapters
and their optimizer states, not the base once more; each rank's file records instead the fingerprint of
that rank's frozen compute shards: the sha256 of each parameter's shard bytes, combined in the layout's
order. The engine fingerprints them as it writes them at ``initialize`` (from a model folder, or
initialized) and again when it loads a checkpoint that holds them. A checkpoint without them is loaded only
into a run whose every rank has the same fingerprint: the same base, sharded over as many ranks.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

METADATA_KEY = "frozen_sha256"
"""Where a shard file saved without the frozen parameters keeps its rank's fingerprint of them."""


class FrozenDigest:
    """This rank's fingerprint of its frozen compute shards: one sha256 per parameter, hashed on a worker."""

    def __init__(self):
        self._digests: dict[int, bytes] = {}
        self._pending: tuple[int, Future] | None = None
        self._pool: ThreadPoolExecutor | None = None

    def add(self, index: int, shard: torch.Tensor) -> None:
        """Fingerprint parameter ``index``'s compute shard (a host tensor left unchanged until the next call).

        The bytes are hashed on a worker beside the caller's next read; one shard at a time, so at most one
        is held for it."""
        self._settle()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, "frozen-sha256")
        data = shard.detach().contiguous().view(torch.uint8).numpy()
        self._pending = (index, self._pool.submit(lambda: hashlib.sha256(data).digest()))

    def hexdigest(self) -> str | None:
        """The fingerprint of every frozen shard fingerprinted so far, in parameter order; None when none is."""
        self._settle()
        if not self._digests:
            return None
        combined = hashlib.sha256()
        for index in sorted(self._digests):
            combined.update(index.to_bytes(8, "little") + self._digests[index])
        return combined.hexdigest()

    def close(self) -> None:
        self._settle()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def _settle(self) -> None:
        if self._pending is not None:
            index, future = self._pending
            self._pending = None
            self._digests[index] = future.result()
