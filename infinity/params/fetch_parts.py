"""The parts every parameter's fetch may use beside its shard: a prefetcher, and host buffers for NVMe reads.
Each is made only where it can serve (the engine gives the rest of :class:`~infinity.params.sharded_param.FetchPath`)."""

from __future__ import annotations

import logging

import torch

from infinity.config.sections import OffloadParamConfig, ZeroConfig
from infinity.config.tier_names import Tier
from infinity.params.compute_shards import ComputeShards
from infinity.params.gathered_blocks import FreshBlocks, ReusedBlocks
from infinity.params.prefetcher import Prefetcher
from infinity.params.sharded_param import needs_copy_up, needs_swap_in
from infinity.placement.copies import Copies
from infinity.placement.layout import ShardLayout
from infinity.placement.placement import Placement
from infinity.placement.tiers import Tiers
from infinity.runtime.comm import Collectives
from infinity.storage import HostBufferPool
from infinity.storage.stats import TierStats

logger = logging.getLogger(__name__)


def prefetcher_for(zero: ZeroConfig, compute: ComputeShards, copies: Copies, layout: ShardLayout, dtype: torch.dtype,
                   device_stats: TierStats, reserve_nbytes: int, comm: Collectives,
                   blocks: FreshBlocks | ReusedBlocks) -> Prefetcher | None:
    """A prefetcher when some shard's fetch can start early (a swap-in or a copy up) and the config asks
    for prefetching or reuse, or, with one memory, when a fetch copies (a shard in the host tier, or several ranks'
    all-gather) and the config asks for reuse: there it keeps what is used again soon gathered instead of copying
    it again (an evaluation's or generate's forwards, a step's micro-batches). Else every parameter is fetched on
    demand. With several ranks in ``comm`` it keeps the same parameters gathered on every rank
    (:meth:`Collectives.least_over_ranks`)."""
    starts_early = any(needs_swap_in(compute, slot) or needs_copy_up(compute, copies, slot) for slot in layout.slots)
    fetch_copies = not copies.distinct and (comm.world_size > 1 or compute.tier != Tier.DEVICE)
    if not ((starts_early and (zero.prefetch_bucket_size or zero.max_reuse_distance))
            or (fetch_copies and zero.max_reuse_distance)):
        return None
    return Prefetcher(zero, itemsize=torch.empty((), dtype=dtype).element_size(), device_stats=device_stats,
                      reserve_nbytes=reserve_nbytes,
                      least_over_ranks=comm.least_over_ranks if comm.world_size > 1 else None,
                      cached_nbytes=lambda: blocks.kept_nbytes)


def read_pool_for(placement: Placement, offload_param: OffloadParamConfig, layout: ShardLayout, dtype: torch.dtype,
                  tiers: Tiers) -> HostBufferPool | None:
    """Host buffers for NVMe reads of shards bound for device memory (with one memory they land in place)."""
    if placement.compute_shard.tier != "nvme" or not placement.distinct:
        return None
    elsize = torch.empty((), dtype=dtype).element_size()
    largest = layout.largest_shard_numel
    buffer_size = offload_param.buffer_size
    if buffer_size < largest:
        logger.warning("offload_param.buffer_size=%d is smaller than the largest shard (%d elements); using %d",
                       buffer_size, largest, largest)
        buffer_size = largest
    return HostBufferPool(offload_param.buffer_count * buffer_size * elsize, pin=placement.compute_shard.pinned,
                          stats=tiers.stats["host"], pinner=tiers.pinner, owner="parameter read buffers")
