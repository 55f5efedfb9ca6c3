"""Gathered parameters' blocks kept for the next fetch where device memory is host memory (``infinity.params.gathered_blocks``).

The reference for the engine is the same engine with fresh blocks from the allocator at every fetch: the same
losses and full state dict bit for bit, and the same device-tier peak (kept blocks never push the gathered
parameters' bytes above the most they have been in use)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import infinity
from helpers import TinyGPT, engine_config, gpt_batches, train_batches
from infinity.params.gathered_blocks import FreshBlocks, ReusedBlocks
from infinity.placement.placement import distinct_device_requested
from infinity.storage import TierStats

pytestmark = pytest.mark.skipif(not ReusedBlocks.available(), reason="this torch cannot swap a storage's bytes")


def _empty_storage() -> torch.UntypedStorage:
    return torch.UntypedStorage(0)


def test_a_released_block_serves_the_next_fetch_of_its_size():
    stats = TierStats("device")
    blocks = ReusedBlocks(stats)
    full = torch.empty(0, dtype=torch.float32)
    storage = full.untyped_storage()
    blocks.take(storage, 4096)
    full.set_(storage, 0, (1024,))
    view = full[:4]
    full.copy_(torch.arange(1024.0))
    first = storage.data_ptr()
    assert torch.equal(view, torch.arange(4.0))  # a view made before reads the block's bytes
    blocks.give_back(storage)
    assert storage.nbytes() == 0 and blocks.kept_nbytes == 4096
    assert stats.live_nbytes == 4096  # kept bytes are device bytes, still counted
    blocks.take(storage, 4096)
    assert storage.data_ptr() == first and blocks.reused == 1 and blocks.kept_nbytes == 0
    assert torch.equal(view, torch.arange(4.0))  # the same bytes: nothing zeroed or moved
    blocks.give_back(storage)
    blocks.close()
    assert stats.live_nbytes == 0 and blocks.kept_nbytes == 0


def test_kept_blocks_never_raise_the_peak_and_give_way_to_the_budget():
    stats = TierStats("device")
    blocks = ReusedBlocks(stats)
    a, b = _empty_storage(), _empty_storage()
    blocks.take(a, 8192)
    blocks.take(b, 4096)
    peak = stats.peak_nbytes
    assert peak == 12288
    blocks.give_back(a)
    blocks.give_back(b)
    # another size: a new block, and a kept one dropped so that in use + kept stays within the peak
    c = _empty_storage()
    blocks.take(c, 4096 * 3 - 100)
    assert stats.peak_nbytes == peak and stats.live_nbytes <= peak
    assert blocks.reused == 0
    blocks.give_back(c)
    blocks.close()
    assert stats.live_nbytes == 0

    budget = TierStats("device", 12288)
    blocks = ReusedBlocks(budget)
    d = _empty_storage()
    blocks.take(d, 12288)
    blocks.give_back(d)  # kept: the budget is all kept bytes now
    e = _empty_storage()
    blocks.take(e, 8192)  # another size: the kept block goes before the budget refuses
    assert budget.live_nbytes == 8192 and blocks.kept_nbytes == 0
    with pytest.raises(MemoryError):
        blocks.take(_empty_storage(), 8192)
    blocks.give_back(e)
    blocks.close()


def _train(model, batches, config, monkeypatch, *, reuse: bool):
    with monkeypatch.context() as patch:
        if not reuse:
            patch.setattr(ReusedBlocks, "available", staticmethod(lambda: False))
        engine = infinity.initialize(copy.deepcopy(model), config)
    try:
        assert isinstance(engine.full_blocks, ReusedBlocks if reuse else FreshBlocks)
        losses = train_batches(engine, batches)
        reused = getattr(engine.full_blocks, "reused", 0)
        return losses, engine.full_state_dict(), engine.tiers.snapshot()["device"]["peak_nbytes"], reused
    finally:
        engine.close()


@pytest.mark.parametrize("param", ["nvme", "cpu"])
def test_the_engine_trains_the_same_on_kept_blocks(tmp_path, monkeypatch, param):
    if distinct_device_requested():
        pytest.skip("device memory apart from host memory: fresh blocks (a GPU's allocator keeps its own)")
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(4, batch=2)
    config = engine_config(param=param, optimizer="nvme", nvme_path=str(tmp_path), accum=1, clip=1.0, lr=3e-3,
                           precision="bf16", sub_group_size=4096, overlap_step_with_backward=True)
    losses, full, peak, _ = _train(model, batches, config, monkeypatch, reuse=False)
    got_losses, got_full, got_peak, reused = _train(model, batches, config, monkeypatch, reuse=True)
    assert got_losses == losses
    for name, value in full.items():
        assert torch.equal(got_full[name], value), name
    assert got_peak == peak
    assert reused > 0


def test_compute_shards_read_from_nvme_land_in_their_blocks_without_a_bounce(tmp_path, caplog):
    """Where device memory is host memory, a fetch reads a compute shard from NVMe straight into the gathered
    parameter's block (page-aligned): after initialize's writes, the swap store bounces no read through a buffer."""
    if distinct_device_requested():
        pytest.skip("device memory apart from host memory: reads land in the read pool's aligned buffers")
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(3, batch=2)
    config = engine_config(param="nvme", optimizer="cpu", nvme_path=str(tmp_path), accum=1, clip=0.0, lr=3e-3)
    with infinity.initialize(model, config) as engine:
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="infinity.storage.swap_store"):
            for x, y in batches:
                engine.backward(engine(x, y))
                engine.step()
        read = engine.tiers.snapshot()["nvme"]["bytes_read"]
    assert read > 0  # the shards were read from NVMe at each fetch
    bounced = [r.getMessage() for r in caplog.records if "swap read" in r.getMessage() and "bouncing" in r.getMessage()]
    assert not bounced, bounced[:3]
