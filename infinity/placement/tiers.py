"""The three tiers as the engine sees them: accounting for device and host
memory, and one swap store per NVMe directory.

On a machine without a GPU the device is the CPU; device bytes are still
counted apart from host bytes, so a budget for each means the same thing on
every machine. In the test mode (``INFINITY_DISTINCT_DEVICE=1``) device
allocations are ordinary tensors apart from the host tier's aligned buffers.

The optimizer's share of device memory (its states and gradient slices resting there) is counted apart too,
within the device tier: ``zero_optimization.device_memory_budget`` is what that share may hold, and an
allocation past it is refused with the key named. What a step takes on the device besides (gathered
parameters, prefetched ones, scratch, the accumulator of offloaded gradients, the copy that undoes a
speculative update) counts in the device tier, outside the budget: the budget is the optimizer's.
"""

from __future__ import annotations

import logging
import os

import torch

from infinity.config.sections import AioConfig
from infinity.config.tier_names import Tier
from infinity.placement.placement import Placement
from infinity.runtime.trace import TracedStore
from infinity.storage import AsyncIO, BackgroundPinner, SwapStore, TierStats, aligned_empty
from infinity.storage.pinning import Pinner
from infinity.storage.stats import format_nbytes

logger = logging.getLogger(__name__)

DEVICE_BUDGET_KEY = "zero_optimization.device_memory_budget"


class Tiers:
    """Owns the accounting of every tier and the swap stores; closed once, by the engine."""

    def __init__(self, aio: AioConfig, placement: Placement, timeline=None, *,
                 host_budget_nbytes: int | None = None, pinner: Pinner | None = None,
                 device_optimizer_budget_nbytes: int | None = None):
        """``aio``: how the swap stores' asynchronous I/O runs (the config's ``aio`` section);
        ``device_optimizer_budget_nbytes``: what the optimizer's share of device memory may hold (the split's
        resolved ``device_memory_budget``; None: no budget)."""
        self.placement = placement
        self.device = placement.device
        self._timeline = timeline
        self._owner_of: dict[int, str] = {}
        """data_ptr -> the owner that :meth:`empty` charged, so :meth:`free` gives the bytes back in its name."""
        # One budget for host memory: host buffers charge it, and so do device buffers where the device is the host.
        self.host_memory = TierStats("host memory", host_budget_nbytes)
        self.stats = {Tier.DEVICE: TierStats("device", within=None if placement.distinct else self.host_memory),
                      Tier.HOST: TierStats("host", within=self.host_memory)}
        self.device_optimizer = TierStats("device (optimizer states and gradient slices)",
                                          device_optimizer_budget_nbytes, within=self.stats[Tier.DEVICE])
        """The optimizer's share of the device tier, within it: charged by :meth:`empty` with ``optimizer_share``."""
        self._io: AsyncIO | None = None
        self._stores: dict[str, SwapStore] = {}
        self._aio = aio
        # Pinned host buffers are registered behind initialize and the first steps (~0.3 s a GB otherwise spent
        # in initialize); until a buffer's turn, its copies are synchronous, which is slower but just as correct.
        self.pinner = pinner if pinner is not None else _background_pinner(placement)

    # -- memory ---------------------------------------------------------------
    def empty(self, tier: str, numel: int, dtype: torch.dtype, *, owner: str, pinned: bool = False,
              optimizer_share: bool = False) -> torch.Tensor:
        """A counted allocation in ``tier`` (``device`` or ``host``); give it back with :meth:`free`.

        ``owner`` says what the bytes are for (the tiers' live bytes are kept by owner, and an allocation
        refused names them); ``pinned`` page-locks a host allocation (where the placement found a GPU to pin for);
        ``optimizer_share``: optimizer states or gradient slices, which in device memory are charged to the
        optimizer's share and its budget (a ``ValueError`` naming ``zero_optimization.device_memory_budget``
        when the allocation would pass it)."""
        nbytes = numel * _itemsize(dtype)
        if tier == Tier.DEVICE and optimizer_share:
            self._charge_optimizer_share(nbytes, owner)
        else:
            self.stats[tier].allocate(nbytes, owner)
        if tier == Tier.DEVICE and self.placement.distinct:
            tensor = torch.empty(numel, dtype=dtype, device=self.device)
        else:
            # Host tensors are aligned so that they can go to NVMe without a bounce.
            tensor = aligned_empty(numel, dtype, pin=pinned and tier == Tier.HOST, pinner=self.pinner)
        if nbytes:
            self._owner_of[tensor.data_ptr()] = owner
        return tensor

    def charges_host_memory(self, tier: str) -> bool:
        """Allocations in ``tier`` charge the host-memory budget (host buffers; device ones where the device is
        the host)."""
        return tier == Tier.HOST or not self.placement.distinct

    def free(self, tier: str, tensor: torch.Tensor, *, optimizer_share: bool = False) -> None:
        """Give back what :meth:`empty` counted (with the same ``optimizer_share``)."""
        nbytes = tensor.numel() * tensor.element_size()
        owner = self._owner_of.pop(tensor.data_ptr(), "other") if nbytes else "other"
        (self.device_optimizer if tier == Tier.DEVICE and optimizer_share else self.stats[tier]).free(nbytes, owner)

    def _charge_optimizer_share(self, nbytes: int, owner: str) -> None:
        share = self.device_optimizer
        budget = share.budget_nbytes
        if budget is not None and share.live_nbytes + nbytes > budget:
            raise ValueError(
                f"{DEVICE_BUDGET_KEY} is {budget} bytes ({format_nbytes(budget)}) for the optimizer's states and "
                f"gradient slices on the device; {share.live_nbytes} bytes ({format_nbytes(share.live_nbytes)}) "
                f"are in use and {nbytes} more bytes ({format_nbytes(nbytes)}) were asked: raise the budget, or "
                f"keep fewer sub-groups on the device")
        share.allocate(nbytes, owner)  # within the device tier: counted there too

    # -- nvme -----------------------------------------------------------------
    def swap_store(self, nvme_path: str) -> SwapStore:
        """The store for ``nvme_path`` (one private directory per run and path); its requests go on the timeline."""
        store = self._swap_store(nvme_path)
        if self._timeline is None:
            return store
        return TracedStore(store, self._timeline)

    def _swap_store(self, nvme_path: str) -> SwapStore:
        key = os.path.realpath(nvme_path)
        if key not in self._stores:
            if self._io is None:
                aio = self._aio
                self._io = AsyncIO(aio.backend, block_size=aio.block_size, queue_depth=aio.queue_depth,
                                   thread_count=aio.thread_count, single_submit=aio.single_submit,
                                   overlap_events=aio.overlap_events)
                logger.info("nvme I/O backend: %s", self._io.backend)
            shared_stats = next(iter(self._stores.values())).stats if self._stores else None
            _make_swap_folder(nvme_path)
            self._stores[key] = SwapStore(nvme_path, io=self._io, stats=shared_stats,
                                          buffered_fallback=self._aio.buffered_fallback)
        return self._stores[key]

    @property
    def nvme_stats(self) -> TierStats | None:
        return next(iter(self._stores.values())).stats if self._stores else None

    def snapshot(self) -> dict:
        out = {name: stats.snapshot() for name, stats in self.stats.items()}
        nvme = self.nvme_stats
        out[Tier.NVME] = nvme.snapshot() if nvme is not None else TierStats("nvme").snapshot()
        return out

    def close(self) -> None:
        if isinstance(self.pinner, BackgroundPinner):
            self.pinner.close()  # the buffers still queued are about to be freed: not worth pinning
        for store in self._stores.values():
            store.close()
        self._stores.clear()
        if self._io is not None:
            self._io.close()
            self._io = None


def _background_pinner(placement: Placement) -> BackgroundPinner | None:
    """A pinner for this run's pinned buffers, or None where nothing is pinned (no GPU, or pinning off)."""
    if placement.device.type != "cuda" or not (placement.compute_shard.pinned or placement.grads.pinned):
        return None
    index = placement.device.index
    return BackgroundPinner(device_index=torch.cuda.current_device() if index is None else index)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _make_swap_folder(nvme_path: str) -> None:
    """A configured ``nvme_path`` that does not exist is made (mode 0700, with its parents), as ``infinity train``
    and DeepSpeed do; one that cannot be is named with the config key."""
    if os.path.isdir(nvme_path):
        return
    if os.path.lexists(nvme_path):
        raise NotADirectoryError(f"zero_optimization nvme_path {nvme_path!r} is not a folder")
    try:
        os.makedirs(nvme_path, mode=0o700, exist_ok=True)
    except OSError as err:
        raise type(err)(err.errno, f"zero_optimization nvme_path {nvme_path!r} does not exist and cannot be made: "
                                   f"{err.strerror}", nvme_path) from None
    logger.info("made the swap folder %s (mode 0700)", nvme_path)
